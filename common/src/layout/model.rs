//! The built-in model families' parameter layouts (MLP and logistic regression, the byte-level GPT) and how the
//! configured model's shape follows from `[model]` and `[data]`: input width and classes, layer widths, the GPT's
//! shape, and the layout itself. Servers and workers both build the configured layout with [`model_layout`], so they
//! agree on it; the configuration stays plain data and knows nothing of models.

use super::{Init, Layout, TensorSpec};
use crate::config::{Config, ConfigError, DatasetKind, ModelConfig, ModelKind};

/// Vocabulary of the byte-level GPT: one token per byte value.
pub const BYTE_VOCAB: usize = 256;

/// The most parameters a configured model may have (2^32: 16 GiB of f32 weights, before optimizer state and
/// copies). A larger `[model]` is a configuration error naming the key, never an overflow.
pub const MAX_MODEL_PARAMS: u64 = 1 << 32;

/// Input width and class count of the configured model: from `[model]` when given, else from the dataset kind. A GPT
/// reads `model.context` byte tokens and predicts one of [`BYTE_VOCAB`] bytes.
pub fn model_io(cfg: &Config) -> Result<(usize, usize), ConfigError> {
    if cfg.model.kind == ModelKind::Gpt {
        return Ok((cfg.model.context, BYTE_VOCAB));
    }
    if cfg.model.kind == ModelKind::File {
        return Err(ConfigError::Invalid {
            key: "model.kind",
            reason: "a model file's inputs are its owner's (the Python module's); Tether does not read them"
                .into(),
        });
    }
    let (f, c) = match cfg.data.dataset {
        DatasetKind::FashionMnist | DatasetKind::Idx => (Some(784), Some(10)),
        DatasetKind::Digits => (Some(64), Some(10)),
        DatasetKind::Csv | DatasetKind::Libsvm => (None, None),
        DatasetKind::Kjv | DatasetKind::KjvExcerpt | DatasetKind::Text => {
            return Err(ConfigError::Invalid {
                key: "model.kind",
                reason: format!(
                    "dataset {} is text: it needs model.kind = \"gpt\"",
                    cfg.data.dataset
                ),
            })
        }
    };
    let features = cfg.model.features.or(f).ok_or(ConfigError::Invalid {
        key: "model.features",
        reason: format!("required for dataset {}", cfg.data.dataset),
    })?;
    let classes = cfg.model.classes.or(c).ok_or(ConfigError::Invalid {
        key: "model.classes",
        reason: format!("required for dataset {}", cfg.data.dataset),
    })?;
    Ok((features, classes))
}

/// Layer widths of the configured model, input first and classes last (`model.hidden` between them for an MLP).
pub fn model_dims(cfg: &Config) -> Result<Vec<usize>, ConfigError> {
    let (features, classes) = model_io(cfg)?;
    let mut dims = vec![features];
    if cfg.model.kind == ModelKind::Mlp {
        dims.extend_from_slice(&cfg.model.hidden);
    }
    dims.push(classes);
    Ok(dims)
}

/// The parameter layout of the configured model (servers and workers must agree on it). Refuses a model of more
/// than [`MAX_MODEL_PARAMS`] parameters ([`model_params`]). For `kind = "file"` it reads the model file, whose
/// layout holds the initial weights.
pub fn model_layout(cfg: &Config) -> Result<Layout, ConfigError> {
    if cfg.model.kind == ModelKind::File {
        let path = cfg.model.file.as_deref().ok_or(ConfigError::Invalid {
            key: "model.file",
            reason: "required for model.kind = \"file\"".into(),
        })?;
        return super::read_model_file(path);
    }
    model_params(cfg)?;
    if cfg.model.kind == ModelKind::Gpt {
        return Ok(gpt_layout(&GptShape::from_model(&cfg.model)));
    }
    Ok(mlp_layout(&model_dims(cfg)?))
}

/// The number of parameters of the configured model, in checked arithmetic: a model of more than
/// [`MAX_MODEL_PARAMS`] parameters (or whose count does not fit in 64 bits) is [`ConfigError::Invalid`] naming the
/// keys that size it.
pub fn model_params(cfg: &Config) -> Result<u64, ConfigError> {
    let (count, key) = if cfg.model.kind == ModelKind::Gpt {
        (
            GptShape::from_model(&cfg.model).checked_params(),
            "model.layers/dim/context",
        )
    } else {
        let key = if cfg.model.kind == ModelKind::Mlp && !cfg.model.hidden.is_empty() {
            "model.hidden"
        } else {
            "model.features/classes"
        };
        (mlp_params(&model_dims(cfg)?), key)
    };
    match count {
        Some(n) if n <= MAX_MODEL_PARAMS => Ok(n),
        _ => Err(ConfigError::Invalid {
            key,
            reason: format!(
                "the model would have {} parameters, more than the {MAX_MODEL_PARAMS} allowed",
                count.map_or_else(|| "over 2^64".to_string(), |n| n.to_string())
            ),
        }),
    }
}

/// The number of parameters of [`mlp_layout`]`(dims)` (a weight `[in, out]` and a bias `[out]` per layer), or `None`
/// if it does not fit in 64 bits.
pub fn mlp_params(dims: &[usize]) -> Option<u64> {
    dims.windows(2).try_fold(0u64, |total, w| {
        let (i, o) = (w[0] as u64, w[1] as u64);
        total.checked_add(i.checked_mul(o)?.checked_add(o)?)
    })
}

/// The layout of a fully connected network with layer widths `dims` (input first, classes last): for each layer k
/// (1-based) `fck.weight` `[in, out]` (He-uniform, bound √(6/in)) then `fck.bias` `[out]` (zeros). With two widths it
/// is multinomial logistic regression. Servers and workers both build the model's layout from this function.
pub fn mlp_layout(dims: &[usize]) -> Layout {
    let mut specs = Vec::with_capacity(2 * dims.len().saturating_sub(1));
    for (k, w) in dims.windows(2).enumerate() {
        let bound = (6.0 / w[0] as f64).sqrt() as f32;
        specs.push(TensorSpec::new(
            format!("fc{}.weight", k + 1),
            &[w[0], w[1]],
            Init::Uniform { bound },
        ));
        specs.push(TensorSpec::new(
            format!("fc{}.bias", k + 1),
            &[w[1]],
            Init::Zeros,
        ));
    }
    Layout::new(specs)
}

/// Shape of the built-in GPT (nanoGPT's naming): a byte-level decoder-only transformer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptShape {
    /// Vocabulary size (256: bytes).
    pub vocab: usize,
    /// Context length in tokens.
    pub context: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads per block (divides `dim`).
    pub heads: usize,
    /// Embedding width.
    pub dim: usize,
}

impl GptShape {
    /// The GPT that `[model]` describes (`layers`, `heads`, `dim`, `context`) over the byte vocabulary.
    pub fn from_model(model: &ModelConfig) -> Self {
        Self {
            vocab: BYTE_VOCAB,
            context: model.context,
            layers: model.layers,
            heads: model.heads,
            dim: model.dim,
        }
    }

    /// Number of parameters: `layers × (12·dim² + 13·dim) + (vocab + context + 2)·dim`. For a shape that
    /// [`GptShape::checked_params`] accepts (every configured one: `model_layout` checks it).
    pub fn params(&self) -> usize {
        let c = self.dim;
        self.layers * (12 * c * c + 13 * c) + (self.vocab + self.context + 2) * c
    }

    /// [`GptShape::params`] in checked arithmetic: `None` if it does not fit in 64 bits.
    pub fn checked_params(&self) -> Option<u64> {
        let [vocab, context, layers, c] =
            [self.vocab, self.context, self.layers, self.dim].map(|v| v as u64);
        let block = c
            .checked_mul(c)?
            .checked_mul(12)?
            .checked_add(c.checked_mul(13)?)?;
        let edges = vocab.checked_add(context)?.checked_add(2)?.checked_mul(c)?;
        layers.checked_mul(block)?.checked_add(edges)
    }
}

/// The layout of the built-in GPT. Weights are `[in, out]` (`y = x·W + b`), normal(0, 0.02) like GPT-2, with the
/// residual projections (`attn.proj`, `mlp.proj`) scaled by 1/√(2·layers); biases zero; layer-norm gains one. The
/// output head is tied to `wte` (no separate tensor). Servers and workers both build the GPT's layout from this
/// function; the candle model checks every tensor it creates against it.
pub fn gpt_layout(g: &GptShape) -> Layout {
    let c = g.dim;
    let w = Init::Normal { std: 0.02 };
    let proj = Init::Normal {
        std: (0.02 / (2.0 * g.layers as f64).sqrt()) as f32,
    };
    let (zeros, ones) = (Init::Zeros, Init::Const { value: 1.0 });
    let mut specs = vec![
        TensorSpec::new("wte", &[g.vocab, c], w),
        TensorSpec::new("wpe", &[g.context, c], w),
    ];
    for l in 0..g.layers {
        let t = |s: &str| format!("h.{l}.{s}");
        specs.extend([
            TensorSpec::new(t("ln_1.weight"), &[c], ones),
            TensorSpec::new(t("ln_1.bias"), &[c], zeros),
            TensorSpec::new(t("attn.qkv.weight"), &[c, 3 * c], w),
            TensorSpec::new(t("attn.qkv.bias"), &[3 * c], zeros),
            TensorSpec::new(t("attn.proj.weight"), &[c, c], proj),
            TensorSpec::new(t("attn.proj.bias"), &[c], zeros),
            TensorSpec::new(t("ln_2.weight"), &[c], ones),
            TensorSpec::new(t("ln_2.bias"), &[c], zeros),
            TensorSpec::new(t("mlp.fc.weight"), &[c, 4 * c], w),
            TensorSpec::new(t("mlp.fc.bias"), &[4 * c], zeros),
            TensorSpec::new(t("mlp.proj.weight"), &[4 * c, c], proj),
            TensorSpec::new(t("mlp.proj.bias"), &[c], zeros),
        ]);
    }
    specs.push(TensorSpec::new("ln_f.weight", &[c], ones));
    specs.push(TensorSpec::new("ln_f.bias", &[c], zeros));
    Layout::new(specs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config::with_servers(vec!["127.0.0.1:1".into()])
    }

    #[test]
    fn io_and_dims_follow_the_dataset_unless_model_states_them() {
        let mut c = cfg();
        assert_eq!(model_io(&c).unwrap(), (784, 10));
        assert_eq!(model_dims(&c).unwrap(), vec![784, 256, 128, 10]);
        c.data.dataset = DatasetKind::Digits;
        c.model.kind = ModelKind::Logreg;
        assert_eq!(model_dims(&c).unwrap(), vec![64, 10]);
        c.data.dataset = DatasetKind::Csv;
        let e = model_io(&c).unwrap_err();
        assert!(e.to_string().contains("model.features"), "{e}");
        c.model.features = Some(5);
        let e = model_io(&c).unwrap_err();
        assert!(e.to_string().contains("model.classes"), "{e}");
        c.model.classes = Some(3);
        assert_eq!(model_io(&c).unwrap(), (5, 3));
        assert_eq!(model_layout(&c).unwrap(), mlp_layout(&[5, 3]));
    }

    #[test]
    fn model_size_is_checked_arithmetic_with_a_cap() {
        let mut c = cfg();
        assert_eq!(
            model_params(&c).unwrap(),
            model_layout(&c).unwrap().len() as u64
        );
        // 784·2^32 + 2^32·2^32 overflows 64 bits.
        c.model.hidden = vec![1 << 32, 1 << 32];
        let e = model_layout(&c).unwrap_err();
        assert!(e.to_string().contains("model.hidden"), "{e}");
        assert!(e.to_string().contains("over 2^64"), "{e}");
        // Fits in 64 bits but is over the cap.
        c.model.hidden = vec![1 << 20, 1 << 13];
        let e = model_params(&c).unwrap_err();
        assert!(e.to_string().contains("model.hidden"), "{e}");
        // Logistic regression: the input width and classes size it.
        c.model.kind = ModelKind::Logreg;
        c.data.dataset = DatasetKind::Csv;
        c.model.features = Some(usize::MAX);
        c.model.classes = Some(3);
        let e = model_params(&c).unwrap_err();
        assert!(e.to_string().contains("model.features/classes"), "{e}");
        // The largest GPT the ranges allow is over the cap.
        let mut g = cfg();
        g.model.kind = ModelKind::Gpt;
        (g.model.layers, g.model.dim, g.model.heads) = (64, 8192, 8);
        let e = model_layout(&g).unwrap_err();
        assert!(e.to_string().contains("model.layers/dim/context"), "{e}");
        let huge = GptShape {
            vocab: usize::MAX,
            ..GptShape::from_model(&g.model)
        };
        assert_eq!(huge.checked_params(), None);
    }

    #[test]
    fn checked_counts_match_the_layouts() {
        for dims in [vec![5, 3], vec![784, 256, 128, 10], vec![1, 1, 1]] {
            assert_eq!(mlp_params(&dims), Some(mlp_layout(&dims).len() as u64));
        }
        let g = GptShape {
            vocab: BYTE_VOCAB,
            context: 16,
            layers: 2,
            heads: 2,
            dim: 8,
        };
        assert_eq!(g.checked_params(), Some(gpt_layout(&g).len() as u64));
        assert_eq!(g.checked_params(), Some(g.params() as u64));
    }

    #[test]
    fn text_needs_a_gpt_and_a_gpt_reads_bytes() {
        let mut c = cfg();
        c.data.dataset = DatasetKind::KjvExcerpt;
        let e = model_io(&c).unwrap_err();
        assert!(e.to_string().contains("model.kind"), "{e}");
        c.model.kind = ModelKind::Gpt;
        assert_eq!(model_io(&c).unwrap(), (c.model.context, BYTE_VOCAB));
        let shape = GptShape::from_model(&c.model);
        assert_eq!((shape.layers, shape.dim), (c.model.layers, c.model.dim));
        assert_eq!(model_layout(&c).unwrap().len(), shape.params());
    }

    #[test]
    fn matrices_scope_exempts_exactly_the_gpts_vectors_on_every_shard() {
        use crate::config::DecayScope;
        let g = GptShape {
            vocab: 256,
            context: 8,
            layers: 2,
            heads: 2,
            dim: 16,
        };
        let l = gpt_layout(&g);
        assert!(l.decay_exempt(0..l.len(), DecayScope::All).is_empty());
        for shards in [1, 3] {
            let mut exempt = vec![false; l.len()];
            for k in 0..shards {
                let r = l.shard_range(k, shards);
                for e in l.decay_exempt(r.clone(), DecayScope::Matrices) {
                    assert!(e.end <= r.len());
                    exempt[r.start + e.start..r.start + e.end]
                        .iter_mut()
                        .for_each(|x| *x = true);
                }
            }
            for (i, t) in l.tensors().iter().enumerate() {
                let want = t.shape.len() < 2;
                assert!(
                    exempt[l.tensor_range(i)].iter().all(|&x| x == want),
                    "{} {:?} over {shards} shards",
                    t.name,
                    t.shape
                );
            }
        }
    }
}
