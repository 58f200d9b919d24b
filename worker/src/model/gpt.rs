//! The built-in GPT: a decoder-only, byte-level transformer written as an ordinary candle module and trained
//! through [`CandleModel`]. Token and position embeddings, pre-norm blocks of causal multi-head self-attention and a
//! GELU (tanh) MLP, a final layer norm and an output head tied to the token embedding; nanoGPT's CPU configuration by
//! default (4 layers, 4 heads, 128 wide, 64-byte context, 0.83 M parameters). Its tensors are exactly
//! [`gpt_layout`]'s, which the shards build without candle. A sample is `context` bytes and its label the byte that
//! follows ([`crate::data::windows`]); the loss is the mean cross-entropy of all `context` next-byte predictions of
//! the window, the prediction the byte after the window. Mixed precision follows autocast: the parameters are f32
//! (the master copy the shards keep), cast to the compute dtype where a matmul uses them; the matmuls, the attention
//! scores and the MLP run in the compute dtype; the residual stream, the layer norms, the attention softmax, the tied
//! output head and the loss stay f32, and every weight's gradient is accumulated in f32 by the casts' backward.

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::VarBuilder;

use tether_common::config::ComputePrecision;
use tether_common::layout::{gpt_layout, GptShape};

use super::candle::{CandleError, CandleModel, CandleModule};
use super::ops;

/// Layer-norm epsilon (GPT-2's).
const LN_EPS: f32 = 1e-5;

/// One layer norm's gain and bias.
struct Norm {
    weight: Tensor,
    bias: Tensor,
}

impl Norm {
    fn new(vb: &VarBuilder<'_>, c: usize) -> candle_core::Result<Self> {
        Ok(Self {
            weight: vb.get(c, "weight")?,
            bias: vb.get(c, "bias")?,
        })
    }

    /// Normalises the last dimension of the f32 residual stream `x`; returns `dtype`.
    fn forward(&self, x: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
        ops::layer_norm(x, &self.weight, &self.bias, LN_EPS)?.to_dtype(dtype)
    }
}

/// `y = x·W + b` with W `[in, out]`, on rows.
struct Dense {
    weight: Tensor,
    bias: Tensor,
}

impl Dense {
    fn new(vb: &VarBuilder<'_>, i: usize, o: usize) -> candle_core::Result<Self> {
        Ok(Self {
            weight: vb.get((i, o), "weight")?,
            bias: vb.get(o, "bias")?,
        })
    }
}

impl Module for Dense {
    /// In `x`'s dtype: the f32 weights are cast to it (autocast).
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dt = x.dtype();
        ops::bias_add(
            &mm(x, &self.weight.to_dtype(dt)?)?,
            &self.bias.to_dtype(dt)?,
        )
    }
}

/// `a·b` in the operands' dtype. Candle's CPU matmul has no bf16 kernel, so bf16 operands are multiplied as a bf16
/// tensor core does: the bf16 values exactly, accumulated in f32, the product rounded to bf16 (and so is its
/// gradient, by the casts' backward).
fn mm(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if a.dtype() == DType::BF16 {
        a.to_dtype(DType::F32)?
            .matmul(&b.to_dtype(DType::F32)?)?
            .to_dtype(DType::BF16)
    } else {
        a.matmul(b)
    }
}

/// One pre-norm transformer block.
struct Block {
    ln_1: Norm,
    qkv: Dense,
    proj: Dense,
    ln_2: Norm,
    fc: Dense,
    mlp_proj: Dense,
}

/// The GPT module.
pub struct Gpt {
    shape: GptShape,
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: Norm,
    dtype: DType,
}

impl Gpt {
    /// Asks `vb` for the tensors of [`gpt_layout`], in its order.
    pub fn new(vb: VarBuilder<'_>, shape: GptShape) -> candle_core::Result<Self> {
        let c = shape.dim;
        let wte = vb.get((shape.vocab, c), "wte")?;
        let wpe = vb.get((shape.context, c), "wpe")?;
        let mut blocks = Vec::with_capacity(shape.layers);
        for l in 0..shape.layers {
            let b = vb.pp(format!("h.{l}"));
            blocks.push(Block {
                ln_1: Norm::new(&b.pp("ln_1"), c)?,
                qkv: Dense::new(&b.pp("attn.qkv"), c, 3 * c)?,
                proj: Dense::new(&b.pp("attn.proj"), c, c)?,
                ln_2: Norm::new(&b.pp("ln_2"), c)?,
                fc: Dense::new(&b.pp("mlp.fc"), c, 4 * c)?,
                mlp_proj: Dense::new(&b.pp("mlp.proj"), 4 * c, c)?,
            });
        }
        let ln_f = Norm::new(&vb.pp("ln_f"), c)?;
        Ok(Self {
            shape,
            wte,
            wpe,
            blocks,
            ln_f,
            dtype: vb.dtype(),
        })
    }

    /// The model's shape.
    pub fn shape(&self) -> GptShape {
        self.shape
    }

    /// Token ids `[rows, context]` of a batch of windows.
    fn ids(&self, x: &[f32], rows: usize) -> candle_core::Result<Tensor> {
        // Window bytes are 0..=255 (data::windows); anything else is clamped into the vocabulary.
        let v = (self.shape.vocab - 1) as f32;
        let ids: Vec<u32> = x.iter().map(|&b| b.clamp(0.0, v) as u32).collect();
        Tensor::from_vec(ids, (rows, self.shape.context), &Device::Cpu)
    }

    /// The final hidden states `[rows·context, dim]` (f32).
    fn hidden(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let (c, nh) = (self.shape.dim, self.shape.heads);
        let hs = c / nh;
        let dt = self.dtype;
        // The residual stream h is f32.
        let tok = self
            .wte
            .embedding(&ids.flatten_all()?)?
            .reshape((b, t * c))?;
        let pos = self.wpe.narrow(0, 0, t)?.flatten_all()?;
        let mut h = ops::bias_add(&tok, &pos)?.reshape((b, t, c))?;
        let scale = 1.0 / (hs as f32).sqrt();
        for blk in &self.blocks {
            let a = blk.ln_1.forward(&h, dt)?.reshape((b * t, c))?;
            let qkv = blk
                .qkv
                .forward(&a)?
                .reshape((b, t, 3, nh, hs))?
                .permute((2, 0, 3, 1, 4))?;
            let q = qkv.get(0)?.contiguous()?;
            let k = qkv.get(1)?.contiguous()?;
            let v = qkv.get(2)?.contiguous()?;
            let att = ops::causal_softmax(&mm(&q, &k.t()?)?.to_dtype(DType::F32)?, scale)?
                .to_dtype(dt)?;
            let y = mm(&att, &v)?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((b * t, c))?;
            h = (h + blk
                .proj
                .forward(&y)?
                .to_dtype(DType::F32)?
                .reshape((b, t, c))?)?;
            let m = blk.ln_2.forward(&h, dt)?.reshape((b * t, c))?;
            let m = blk
                .mlp_proj
                .forward(&ops::fused_gelu(&blk.fc.forward(&m)?)?)?;
            h = (h + m.to_dtype(DType::F32)?.reshape((b, t, c))?)?;
        }
        self.ln_f.forward(&h, DType::F32)?.reshape((b * t, c))
    }

    /// The tied head `wte`ᵀ (f32: the head's logits and the loss stay f32).
    fn head(&self) -> candle_core::Result<Tensor> {
        self.wte.t()
    }

    /// Logits `[rows·context, vocab]` in f32.
    fn logits(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.hidden(ids)?.matmul(&self.head()?)
    }
}

impl CandleModule for Gpt {
    fn loss(&self, x: &[f32], y: &[u32], rows: usize) -> candle_core::Result<Tensor> {
        let t = self.shape.context;
        let ids = self.ids(x, rows)?;
        // Targets: the window shifted by one, then the label.
        let mut targets = Vec::with_capacity(rows * t);
        for (r, &label) in y.iter().enumerate() {
            targets.extend(
                x[r * t + 1..(r + 1) * t]
                    .iter()
                    .map(|&b| b.clamp(0.0, 255.0) as u32),
            );
            targets.push(label.min(self.shape.vocab as u32 - 1));
        }
        let targets = Tensor::from_vec(targets, rows * t, &Device::Cpu)?;
        ops::cross_entropy(&self.logits(&ids)?, &targets)
    }

    fn predict(&self, x: &[f32], rows: usize, out: &mut [u32]) -> candle_core::Result<()> {
        let t = self.shape.context;
        let ids = self.ids(x, rows)?;
        let h = self.hidden(&ids)?.reshape((rows, t, self.shape.dim))?;
        let last = h.narrow(1, t - 1, 1)?.squeeze(1)?;
        let pred = last
            .matmul(&self.head()?)?
            .argmax(D::Minus1)?
            .to_vec1::<u32>()?;
        out.copy_from_slice(&pred);
        Ok(())
    }
}

/// The built-in GPT of `shape` as a Tether model, computing in `precision`.
pub fn gpt_model(
    shape: GptShape,
    precision: ComputePrecision,
) -> Result<CandleModel<Gpt>, CandleError> {
    CandleModel::with_layout(
        gpt_layout(&shape),
        shape.context,
        shape.vocab,
        precision,
        |vb| Gpt::new(vb, shape),
    )
}
