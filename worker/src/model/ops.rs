//! Fused CPU kernels for candle models, each with its backward: the tanh-approximated GELU. Candle's own GELU
//! evaluates `tanh` and `powf` per element forward and again backward, which measured 23 % of a GPT step (perf,
//! `examples/gpt_step`); this one computes `x³` by multiplication and `tanh` from one `exp`, and its backward is a
//! second fused pass over `(x, dy)`. Math in f32 for every storage dtype (f32, bf16, f16).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};
use half::{bf16, f16};

/// √(2/π).
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// GELU's cubic coefficient.
const GELU_C: f32 = 0.044_715;

/// A storage element whose arithmetic is done in f32.
trait Elem: Copy + Send + Sync + 'static {
    fn get(self) -> f32;
    fn put(v: f32) -> Self;
}

impl Elem for f32 {
    fn get(self) -> f32 {
        self
    }
    fn put(v: f32) -> Self {
        v
    }
}

impl Elem for bf16 {
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn put(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl Elem for f16 {
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn put(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// `tanh(u)` from one exponential, saturating cleanly for large |u|.
#[inline]
fn tanh(u: f32) -> f32 {
    let u = u.clamp(-15.0, 15.0);
    let e = (2.0 * u).exp();
    (e - 1.0) / (e + 1.0)
}

#[inline]
fn gelu(x: f32) -> f32 {
    let t = tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_C * x * x));
    0.5 * x * (1.0 + t)
}

#[inline]
fn gelu_grad(x: f32) -> f32 {
    let x2 = x * x;
    let t = tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_C * x2));
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x2)
}

/// The contiguous elements of `layout` in `v`.
fn contiguous<'a, T>(v: &'a [T], layout: &Layout, op: &str) -> candle_core::Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{op}: needs a contiguous input"),
    }
}

fn map1<T: Elem>(x: &[T], f: impl Fn(f32) -> f32) -> Vec<T> {
    x.iter().map(|&v| T::put(f(v.get()))).collect()
}

fn map2<T: Elem>(x: &[T], g: &[T], f: impl Fn(f32, f32) -> f32) -> Vec<T> {
    x.iter().zip(g).map(|(&a, &b)| T::put(f(a.get(), b.get()))).collect()
}

/// GELU (tanh approximation), forward.
struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "tether-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(map1(contiguous(v, l, "gelu")?, gelu)),
            CpuStorage::BF16(v) => CpuStorage::BF16(map1(contiguous(v, l, "gelu")?, gelu)),
            CpuStorage::F16(v) => CpuStorage::F16(map1(contiguous(v, l, "gelu")?, gelu)),
            _ => candle_core::bail!("gelu: unsupported dtype"),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let dy = dy.contiguous()?;
        Ok(Some(x.apply_op2_no_bwd(&dy, &GeluBackward)?))
    }
}

/// `dy · gelu'(x)`.
struct GeluBackward;

impl CustomOp2 for GeluBackward {
    fn name(&self) -> &'static str {
        "tether-gelu-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let f = |x: f32, g: f32| g * gelu_grad(x);
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => {
                CpuStorage::F32(map2(contiguous(x, l1, "gelu")?, contiguous(g, l2, "gelu")?, f))
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(g)) => {
                CpuStorage::BF16(map2(contiguous(x, l1, "gelu")?, contiguous(g, l2, "gelu")?, f))
            }
            (CpuStorage::F16(x), CpuStorage::F16(g)) => {
                CpuStorage::F16(map2(contiguous(x, l1, "gelu")?, contiguous(g, l2, "gelu")?, f))
            }
            _ => candle_core::bail!("gelu backward: mismatched or unsupported dtypes"),
        };
        Ok((out, l1.shape().clone()))
    }
}

/// GELU (tanh approximation) of `x`, differentiable, fused forward and backward.
pub fn fused_gelu(x: &Tensor) -> candle_core::Result<Tensor> {
    let x = x.contiguous()?;
    x.apply_op1(Gelu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn fused_gelu_matches_candles_and_so_does_its_gradient() {
        let v: Vec<f32> = (0..401).map(|i| (i as f32 - 200.0) / 25.0).collect();
        let x = Var::from_vec(v, 401, &Device::Cpu).unwrap();
        let ours = fused_gelu(x.as_tensor()).unwrap();
        let theirs = x.as_tensor().gelu().unwrap();
        let d = (&ours - &theirs).unwrap().abs().unwrap().max(0).unwrap();
        assert!(d.to_scalar::<f32>().unwrap() < 1e-5);
        let w = Tensor::arange(0f32, 401., &Device::Cpu).unwrap();
        let g1 = ours.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = theirs.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        let (a, b) = (g1.get(&x).unwrap(), g2.get(&x).unwrap());
        let rel = ((a - b).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap())
            / 400.0;
        assert!(rel < 1e-5, "gradient differs by {rel} (relative to the largest weight)");
    }
}
