//! `[model]`: which model family is trained and its hyperparameters (MLP widths, GPT depth, heads, width and
//! context, the weights' seed, optional input width and classes). Plain data: the shapes and layouts derived from it
//! live in [`crate::layout::model`].

use serde::{Deserialize, Serialize};

/// Built-in model families.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// Multi-layer perceptron with ReLU hidden layers and softmax cross-entropy.
    #[default]
    Mlp,
    /// Multinomial logistic regression.
    Logreg,
    /// Decoder-only byte-level transformer (candle; `[model] layers heads dim context`), trained on a text dataset.
    Gpt,
    /// A model defined outside Rust (a PyTorch module through the Python package): layout and initial weights come
    /// from the model file `model.file`; its workers compute the gradients.
    File,
}

/// `[model]`: what is trained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Model family (default mlp).
    pub kind: ModelKind,
    /// Hidden layer widths for the MLP (default [256, 128]).
    pub hidden: Vec<usize>,
    /// Seed of the initial weights (default 42).
    pub seed: u64,
    /// Input width (default: from the dataset kind — 784 for fashion-mnist/idx, 64 for digits; required for
    /// csv/libsvm so servers need not read the data).
    pub features: Option<usize>,
    /// Number of classes (default 10 for the built-in datasets; required for csv/libsvm).
    pub classes: Option<usize>,
    /// GPT: transformer blocks (default 4).
    pub layers: usize,
    /// GPT: attention heads per block (default 4; must divide `dim`).
    pub heads: usize,
    /// GPT: embedding width (default 128).
    pub dim: usize,
    /// GPT: context length in bytes (default 64).
    pub context: usize,
    /// `kind = "file"`: the model file (safetensors of f32 tensors, written by `tether.write_model_file` or
    /// `tether.torch.export_model`) holding the layout and the initial weights (required for that kind).
    pub file: Option<std::path::PathBuf>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            kind: ModelKind::Mlp,
            hidden: vec![256, 128],
            seed: 42,
            features: None,
            classes: None,
            layers: 4,
            heads: 4,
            dim: 128,
            context: 64,
            file: None,
        }
    }
}
