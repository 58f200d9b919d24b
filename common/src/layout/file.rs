//! Model files: a model defined outside Rust (a PyTorch module, through the Python package) hands Tether its
//! parameter layout and initial weights as one safetensors file of f32 tensors, whose metadata key
//! [`ORDER_KEY`] lists the tensor names in layout order (the module's `named_parameters()` order). Shards read it
//! with `[model] kind = "file"` and start from its values; workers pull those values before their first step, so
//! every worker starts from the same weights. The file is untrusted input: [`decode_model_file`] bounds its size,
//! names and tensor count, refuses other dtypes and non-finite values with a typed error and never panics.

use std::path::Path;

use super::{Layout, MAX_MODEL_PARAMS};
use crate::config::ConfigError;

/// Metadata key holding the tensor names in layout order (a JSON array of strings).
pub const ORDER_KEY: &str = "tether.order";

/// Most tensors a model file may hold.
pub const MAX_TENSORS: usize = 1 << 16;

/// Longest tensor name (bytes).
pub const MAX_NAME_BYTES: usize = 512;

/// Largest model file read: [`MAX_MODEL_PARAMS`] f32 values plus a 100 MB header (safetensors' own header bound).
pub const MAX_MODEL_FILE_BYTES: u64 = MAX_MODEL_PARAMS * 4 + 100_000_000 + 8;

/// Encodes `tensors` (name, shape, row-major values) as a model file, in the given order.
pub fn encode_model_file(tensors: &[(&str, &[usize], &[f32])]) -> Result<Vec<u8>, String> {
    check_names(tensors.iter().map(|t| t.0))?;
    let mut total = 0u64;
    let mut bytes: Vec<Vec<u8>> = Vec::with_capacity(tensors.len());
    for (name, shape, values) in tensors {
        let n = numel(shape).ok_or_else(|| format!("tensor {name}: shape {shape:?} overflows"))?;
        if n != values.len() {
            return Err(format!(
                "tensor {name}: shape {shape:?} holds {n} values, {} given",
                values.len()
            ));
        }
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(format!("tensor {name}: value {i} is not finite"));
        }
        total += n as u64;
        bytes.push(values.iter().flat_map(|v| v.to_le_bytes()).collect());
    }
    if total > MAX_MODEL_PARAMS {
        return Err(format!(
            "{total} parameters, more than the {MAX_MODEL_PARAMS} allowed"
        ));
    }
    let mut views = Vec::with_capacity(tensors.len());
    for ((name, shape, _), b) in tensors.iter().zip(&bytes) {
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.to_vec(), b)
            .map_err(|e| format!("tensor {name}: {e}"))?;
        views.push((name.to_string(), view));
    }
    let order: Vec<&str> = tensors.iter().map(|t| t.0).collect();
    let order = serde_json::to_string(&order).map_err(|e| e.to_string())?;
    let meta = std::collections::HashMap::from([(ORDER_KEY.to_string(), order)]);
    safetensors::serialize(views, Some(meta)).map_err(|e| e.to_string())
}

/// Decodes a model file into a layout holding its initial values ([`super::Init::Given`] tensors).
pub fn decode_model_file(bytes: &[u8]) -> Result<Layout, String> {
    if bytes.len() as u64 > MAX_MODEL_FILE_BYTES {
        return Err(format!(
            "{} bytes, more than the {MAX_MODEL_FILE_BYTES} allowed",
            bytes.len()
        ));
    }
    let file = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| format!("not a safetensors file: {e}"))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| format!("not a safetensors file: {e}"))?;
    let order = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get(ORDER_KEY))
        .ok_or_else(|| {
            format!("no `{ORDER_KEY}` metadata (write it with tether.write_model_file)")
        })?;
    let order: Vec<String> = serde_json::from_str(order)
        .map_err(|e| format!("`{ORDER_KEY}` is not a JSON list of names: {e}"))?;
    check_names(order.iter().map(String::as_str))?;
    if order.len() != file.len() {
        return Err(format!(
            "`{ORDER_KEY}` lists {} tensors, the file holds {}",
            order.len(),
            file.len()
        ));
    }
    let mut total = 0u64;
    let mut tensors = Vec::with_capacity(order.len());
    let mut views = Vec::with_capacity(order.len());
    for name in order {
        let view = file
            .tensor(&name)
            .map_err(|_| format!("`{ORDER_KEY}` names {name}, which the file lacks"))?;
        if view.dtype() != safetensors::Dtype::F32 {
            return Err(format!(
                "tensor {name} is {:?}; model files hold f32",
                view.dtype()
            ));
        }
        let n = numel(view.shape()).ok_or_else(|| format!("tensor {name}: shape overflows"))?;
        total = total.saturating_add(n as u64);
        if total > MAX_MODEL_PARAMS {
            return Err(format!(
                "more than the {MAX_MODEL_PARAMS} parameters allowed"
            ));
        }
        tensors.push((name, view.shape().to_vec()));
        views.push(view);
    }
    let mut values = Vec::with_capacity(total as usize);
    for ((name, _), view) in tensors.iter().zip(&views) {
        let start = values.len();
        values.extend(
            view.data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
        if let Some(i) = values[start..].iter().position(|v| !v.is_finite()) {
            return Err(format!("tensor {name}: value {i} is not finite"));
        }
    }
    Layout::with_values(tensors, values)
        .ok_or_else(|| "tensor sizes do not add up to the values".to_string())
}

/// Reads and decodes the model file at `path` (bounded by [`MAX_MODEL_FILE_BYTES`]).
pub fn read_model_file(path: &Path) -> Result<Layout, ConfigError> {
    let err = |reason: String| ConfigError::ModelFile {
        path: path.to_path_buf(),
        reason,
    };
    let len = std::fs::metadata(path)
        .map_err(|e| err(e.to_string()))?
        .len();
    if len > MAX_MODEL_FILE_BYTES {
        return Err(err(format!(
            "{len} bytes, more than the {MAX_MODEL_FILE_BYTES} allowed"
        )));
    }
    let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    decode_model_file(&bytes).map_err(err)
}

/// Encodes `tensors` and writes them to `path` (through a temporary file renamed into place).
pub fn write_model_file(
    path: &Path,
    tensors: &[(&str, &[usize], &[f32])],
) -> Result<(), ConfigError> {
    let err = |reason: String| ConfigError::ModelFile {
        path: path.to_path_buf(),
        reason,
    };
    let bytes = encode_model_file(tensors).map_err(err)?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, &bytes).map_err(|e| err(e.to_string()))?;
    std::fs::rename(&tmp, path).map_err(|e| err(e.to_string()))
}

fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

fn check_names<'a>(names: impl Iterator<Item = &'a str>) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for name in names {
        if seen.len() >= MAX_TENSORS {
            return Err(format!("more than {MAX_TENSORS} tensors"));
        }
        if name.is_empty() || name.len() > MAX_NAME_BYTES {
            return Err(format!(
                "tensor name of {} bytes (1 to {MAX_NAME_BYTES} allowed)",
                name.len()
            ));
        }
        if !seen.insert(name) {
            return Err(format!("tensor {name} appears twice"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        encode_model_file(&[
            ("fc.weight", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
            ("fc.bias", &[2], &[0.5, -0.5]),
            ("alpha", &[], &[7.0]),
        ])
        .unwrap()
    }

    #[test]
    fn round_trip_keeps_order_shapes_and_values() {
        let layout = decode_model_file(&sample()).unwrap();
        let names: Vec<&str> = layout.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["fc.weight", "fc.bias", "alpha"]);
        assert_eq!(layout.tensors()[0].shape, [2, 3]);
        assert_eq!(layout.len(), 9);
        assert_eq!(
            layout.init_all(0),
            [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.5, -0.5, 7.0]
        );
        // Any split into shards reproduces the same values.
        let mut part = vec![0.0; 4];
        layout.init_range(99, 5..9, &mut part);
        assert_eq!(part, [6.0, 0.5, -0.5, 7.0]);
    }

    #[test]
    fn other_values_give_another_hash() {
        let a = decode_model_file(&sample()).unwrap();
        let b = decode_model_file(
            &encode_model_file(&[
                ("fc.weight", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.5]),
                ("fc.bias", &[2], &[0.5, -0.5]),
                ("alpha", &[], &[7.0]),
            ])
            .unwrap(),
        )
        .unwrap();
        assert_ne!(a.hash(), b.hash());
        assert_eq!(a.hash(), decode_model_file(&sample()).unwrap().hash());
    }

    #[test]
    fn refuses_bad_input_without_panicking() {
        assert!(encode_model_file(&[("a", &[2], &[1.0])]).is_err());
        assert!(encode_model_file(&[("a", &[1], &[f32::NAN])]).is_err());
        assert!(encode_model_file(&[("a", &[1], &[1.0]), ("a", &[1], &[1.0])]).is_err());
        let good = sample();
        // Every truncation and single-byte corruption is an error or a valid layout, never a panic.
        for cut in 0..good.len() {
            let _ = decode_model_file(&good[..cut]);
        }
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0xff;
            let _ = decode_model_file(&bad);
        }
        // A safetensors file without the order is refused, naming the key.
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &[0, 0, 0, 0])
                .unwrap();
        let plain = safetensors::serialize([("a", view)], None).unwrap();
        assert!(decode_model_file(&plain).unwrap_err().contains(ORDER_KEY));
        // Non-finite values written by someone else are refused.
        let nan = f32::NAN.to_le_bytes();
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &nan).unwrap();
        let meta =
            std::collections::HashMap::from([(ORDER_KEY.to_string(), "[\"a\"]".to_string())]);
        let bad = safetensors::serialize([("a", view)], Some(meta)).unwrap();
        assert!(decode_model_file(&bad).unwrap_err().contains("not finite"));
    }
}
