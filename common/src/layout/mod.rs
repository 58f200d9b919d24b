//! The model's flat parameter space: named tensors laid end to end in one f32 index space, how shards split it, and
//! the deterministic initial values. Everything here is a pure function of its inputs: the initial value of a
//! parameter depends only on (seed, tensor, global index), never on how many shards the layout is split into.
//! [`model`] holds the built-in model families' layouts and their derivation from `cluster.toml`, which servers and
//! workers both use so that they agree on the space.

use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::config::DecayScope;
use crate::splitmix::splitmix64;

pub mod file;
pub mod model;

pub use file::{decode_model_file, encode_model_file, read_model_file, write_model_file};
pub use model::{
    gpt_layout, mlp_layout, mlp_params, model_dims, model_io, model_layout, model_params, GptShape,
    MAX_MODEL_PARAMS,
};

/// How a tensor's initial values are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Init {
    /// All zeros (biases).
    Zeros,
    /// Uniform on (−bound, bound) (He/Glorot-uniform weights).
    Uniform {
        /// Half-width of the interval.
        bound: f32,
    },
    /// Normal with mean 0 and this standard deviation (transformer weights, candle's `Randn`).
    Normal {
        /// Standard deviation.
        std: f32,
    },
    /// Every value equal to `value` (layer-norm gains are ones).
    Const {
        /// The value.
        value: f32,
    },
    /// Values given by a model file ([`file`]): the layout holds them; `digest` fingerprints them (FNV-1a of the
    /// tensor's little-endian bytes), so layouts with other initial values hash differently.
    Given {
        /// FNV-1a of the values' little-endian bytes.
        digest: u64,
    },
}

/// One named tensor of the layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Name, unique within the layout (e.g. `fc1.weight`).
    pub name: String,
    /// Shape, row-major.
    pub shape: Vec<usize>,
    /// Initialisation rule.
    pub init: Init,
}

impl TensorSpec {
    /// A tensor with the given name, shape and init.
    pub fn new(name: impl Into<String>, shape: &[usize], init: Init) -> Self {
        Self {
            name: name.into(),
            shape: shape.to_vec(),
            init,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Named tensors laid end to end in one flat f32 index space.
#[derive(Clone, PartialEq)]
pub struct Layout {
    tensors: Vec<TensorSpec>,
    offsets: Vec<usize>,
    total: usize,
    /// The initial values of the whole layout, for a layout read from a model file (every tensor [`Init::Given`]).
    given: Option<Arc<[f32]>>,
}

impl std::fmt::Debug for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The given values may be millions of numbers: their count only.
        f.debug_struct("Layout")
            .field("tensors", &self.tensors)
            .field("total", &self.total)
            .field("given", &self.given.as_ref().map(|v| v.len()))
            .finish()
    }
}

impl Layout {
    /// Lays the tensors end to end in the given order.
    pub fn new(tensors: Vec<TensorSpec>) -> Self {
        let mut offsets = Vec::with_capacity(tensors.len());
        let mut total = 0usize;
        for t in &tensors {
            offsets.push(total);
            total += t.numel();
        }
        Self {
            tensors,
            offsets,
            total,
            given: None,
        }
    }

    /// A layout whose initial values are given (a model file): `tensors` are (name, shape) in layout order and
    /// `values` the whole flat vector. Each tensor becomes [`Init::Given`] with its values' digest. `None` when
    /// the values do not cover the tensors exactly.
    pub fn with_values(tensors: Vec<(String, Vec<usize>)>, values: Vec<f32>) -> Option<Self> {
        let mut specs = Vec::with_capacity(tensors.len());
        let mut at = 0usize;
        for (name, shape) in tensors {
            let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
            let end = at.checked_add(n)?;
            let mut h = Fnv1a::new();
            for v in values.get(at..end)? {
                h.write(&v.to_le_bytes());
            }
            specs.push(TensorSpec {
                name,
                shape,
                init: Init::Given { digest: h.finish() },
            });
            at = end;
        }
        if at != values.len() {
            return None;
        }
        let mut layout = Self::new(specs);
        layout.given = Some(values.into());
        Some(layout)
    }

    /// Total number of parameters.
    pub fn len(&self) -> usize {
        self.total
    }

    /// True when the layout holds no parameters.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// The tensors in layout order.
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// The flat index range of tensor `i`.
    pub fn tensor_range(&self, i: usize) -> Range<usize> {
        let start = self.offsets[i];
        start..start + self.tensors[i].numel()
    }

    /// The flat index range of the tensor called `name`, if any.
    pub fn range_of(&self, name: &str) -> Option<Range<usize>> {
        self.tensors
            .iter()
            .position(|t| t.name == name)
            .map(|i| self.tensor_range(i))
    }

    /// A stable 64-bit fingerprint of names, shapes and inits (FNV-1a); peers with different layouts refuse each other.
    pub fn hash(&self) -> u64 {
        let mut h = Fnv1a::new();
        h.write(&(self.tensors.len() as u64).to_le_bytes());
        for t in &self.tensors {
            h.write(&(t.name.len() as u64).to_le_bytes());
            h.write(t.name.as_bytes());
            h.write(&(t.shape.len() as u64).to_le_bytes());
            for d in &t.shape {
                h.write(&(*d as u64).to_le_bytes());
            }
            match t.init {
                Init::Zeros => h.write(&[0]),
                Init::Uniform { bound } => {
                    h.write(&[1]);
                    h.write(&bound.to_le_bytes());
                }
                Init::Normal { std } => {
                    h.write(&[2]);
                    h.write(&std.to_le_bytes());
                }
                Init::Const { value } => {
                    h.write(&[3]);
                    h.write(&value.to_le_bytes());
                }
                Init::Given { digest } => {
                    h.write(&[4]);
                    h.write(&digest.to_le_bytes());
                }
            }
        }
        h.finish()
    }

    /// The parts of `range` (relative to its start) that weight decay skips under `scope`: with
    /// [`DecayScope::Matrices`] every tensor of rank below 2 (biases, norm gains and biases), nanoGPT's grouping; with
    /// [`DecayScope::All`] nothing.
    pub fn decay_exempt(&self, range: Range<usize>, scope: DecayScope) -> Vec<Range<usize>> {
        if scope == DecayScope::All {
            return Vec::new();
        }
        let mut out: Vec<Range<usize>> = Vec::new();
        for (i, t) in self.tensors().iter().enumerate() {
            if t.shape.len() >= 2 {
                continue;
            }
            let r = self.tensor_range(i);
            let (a, b) = (r.start.max(range.start), r.end.min(range.end));
            if a >= b {
                continue;
            }
            let rel = a - range.start..b - range.start;
            match out.last_mut() {
                Some(last) if last.end == rel.start => last.end = rel.end,
                _ => out.push(rel),
            }
        }
        out
    }

    /// The balanced contiguous range owned by shard `shard` of `shards` (sizes differ by at most one).
    pub fn shard_range(&self, shard: usize, shards: usize) -> Range<usize> {
        shard_range(self.total, shard, shards)
    }

    /// Writes the initial values of the flat indices `range` into `out` (`out.len() == range.len()`).
    ///
    /// Each value is a pure function of (seed, tensor index, global index), so any split into shards reproduces the
    /// same initial model.
    pub fn init_range(&self, seed: u64, range: Range<usize>, out: &mut [f32]) {
        assert_eq!(
            out.len(),
            range.len(),
            "init_range: output length must equal the range length"
        );
        for (ti, t) in self.tensors.iter().enumerate() {
            let tr = self.tensor_range(ti);
            let lo = tr.start.max(range.start);
            let hi = tr.end.min(range.end);
            if lo >= hi {
                continue;
            }
            let dst = &mut out[lo - range.start..hi - range.start];
            match t.init {
                Init::Zeros => dst.fill(0.0),
                Init::Uniform { bound } => {
                    for (k, v) in dst.iter_mut().enumerate() {
                        let idx = (lo + k) as u64;
                        let r = splitmix64(seed ^ splitmix64((ti as u64) << 40 ^ idx));
                        // 24 random bits -> uniform in [0, 1), then to (-bound, bound).
                        let u = (r >> 40) as f32 * (1.0 / (1u64 << 24) as f32);
                        *v = (2.0 * u - 1.0) * bound;
                    }
                }
                Init::Normal { std } => {
                    for (k, v) in dst.iter_mut().enumerate() {
                        let idx = (lo + k) as u64;
                        let r = splitmix64(seed ^ splitmix64((ti as u64) << 40 ^ idx));
                        // Box–Muller on two 32-bit halves: u1 in (0, 1], u2 in [0, 1).
                        let u1 = ((r >> 32) as f64 + 1.0) / (1u64 << 32) as f64;
                        let u2 = (r & 0xffff_ffff) as f64 / (1u64 << 32) as f64;
                        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                        *v = (z * f64::from(std)) as f32;
                    }
                }
                Init::Const { value } => dst.fill(value),
                // Only `with_values` makes Given tensors, and it stores values covering every tensor.
                Init::Given { .. } => match self.given.as_deref() {
                    Some(v) => dst.copy_from_slice(&v[lo..hi]),
                    None => dst.fill(0.0),
                },
            }
        }
    }

    /// The whole initial parameter vector.
    pub fn init_all(&self, seed: u64) -> Vec<f32> {
        let mut v = vec![0.0; self.total];
        self.init_range(seed, 0..self.total, &mut v);
        v
    }
}

/// Balanced contiguous split of `total` elements: shard `shard` of `shards` (the first `total % shards` get one more).
pub fn shard_range(total: usize, shard: usize, shards: usize) -> Range<usize> {
    assert!(
        shards > 0 && shard < shards,
        "shard_range: shard {shard} out of {shards}"
    );
    let base = total / shards;
    let extra = total % shards;
    let start = shard * base + shard.min(extra);
    let len = base + usize::from(shard < extra);
    start..start + len
}

/// The part of a shard's range (`len` values, relative to its start) that round `clock` synchronizes when the model
/// is streamed in `fragments` fragments (`train.fragments`): part `clock mod fragments` of a balanced contiguous split.
/// With one fragment it is the whole range.
pub fn fragment_part(len: usize, clock: u64, fragments: u32) -> Range<usize> {
    let f = u64::from(fragments.max(1));
    shard_range(len, (clock % f) as usize, f as usize)
}

struct Fnv1a(u64);

impl Fnv1a {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mlp() -> Layout {
        Layout::new(vec![
            TensorSpec::new("w1", &[7, 5], Init::Uniform { bound: 0.5 }),
            TensorSpec::new("b1", &[5], Init::Zeros),
            TensorSpec::new("w2", &[5, 3], Init::Uniform { bound: 0.3 }),
        ])
    }

    #[test]
    fn shard_ranges_partition_the_space_and_are_balanced() {
        for total in [0usize, 1, 7, 100, 1001] {
            for shards in 1..6 {
                let mut next = 0;
                for s in 0..shards {
                    let r = shard_range(total, s, shards);
                    assert_eq!(r.start, next);
                    assert!(r.len() == total / shards || r.len() == total / shards + 1);
                    next = r.end;
                }
                assert_eq!(next, total);
            }
        }
    }

    #[test]
    fn init_is_independent_of_sharding() {
        let l = mlp();
        let whole = l.init_all(42);
        for shards in 1..5 {
            let mut pieces = Vec::new();
            for s in 0..shards {
                let r = l.shard_range(s, shards);
                let mut buf = vec![0.0; r.len()];
                l.init_range(42, r, &mut buf);
                pieces.extend(buf);
            }
            assert_eq!(pieces, whole);
        }
        assert_ne!(l.init_all(43), whole);
        let b1 = l.range_of("b1").unwrap();
        assert!(whole[b1].iter().all(|v| *v == 0.0));
        let w1 = l.range_of("w1").unwrap();
        assert!(whole[w1.clone()].iter().all(|v| v.abs() < 0.5));
        let mean: f32 = whole[w1.clone()].iter().sum::<f32>() / w1.len() as f32;
        assert!(mean.abs() < 0.2);
    }

    #[test]
    fn init_values_are_pinned() {
        // Reproducibility contract: these values were produced before splitmix64 moved to `crate::splitmix`; a
        // change here changes every run's initial weights.
        let l = Layout::new(vec![
            TensorSpec::new("a", &[7], Init::Zeros),
            TensorSpec::new("b", &[8], Init::Uniform { bound: 0.5 }),
            TensorSpec::new("c", &[2], Init::Normal { std: 0.02 }),
        ]);
        let v = l.init_all(42);
        assert_eq!(v[7].to_bits(), 0xbe57_c0bc, "uniform {}", v[7]);
        assert!((v[15] - 0.025_554_849).abs() < 1e-9, "normal {}", v[15]);
    }

    #[test]
    fn hash_tracks_shape_and_names() {
        let a = mlp();
        let mut t = a.tensors().to_vec();
        t[2].shape = vec![5, 4];
        assert_ne!(a.hash(), Layout::new(t).hash());
        assert_eq!(a.hash(), mlp().hash());
    }
}
