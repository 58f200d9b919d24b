//! Worker-side error feedback for one shard's range: the residual `r` that quantization left behind.
//!
//! Each push encodes `g + r` and keeps `r ← (g + r) − decode(frame)`, so over many pushes the sum of what the server
//! received tracks the sum of true gradients up to the current residual (bounded by one bucket step per element).
//! Invariant: `r` changes only when a frame was successfully produced; buffers are allocated once, on first use.

use super::{CodecError, Encoder};

/// The residual of one shard's range and the scratch needed to update it without allocating.
#[derive(Debug)]
pub struct ErrorFeedback {
    residual: Vec<f32>,
    sum: Vec<f32>,
    decoded: Vec<f32>,
}

impl ErrorFeedback {
    /// A zero residual for a range of `len` elements.
    pub fn new(len: usize) -> Self {
        ErrorFeedback {
            residual: vec![0.0; len],
            sum: Vec::new(),
            decoded: Vec::new(),
        }
    }

    /// The range's length, or a length mismatch for a gradient of `len` values (with `out` cleared).
    fn check_len(&self, len: usize, out: &mut Vec<u8>) -> Result<usize, CodecError> {
        let n = self.residual.len();
        if len != n {
            out.clear();
            return Err(CodecError::LengthMismatch {
                expected: n as u64,
                found: len as u64,
            });
        }
        Ok(n)
    }

    /// The current residual.
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Adds `undelivered` (the decoded values of a frame that no shard applied) back into the residual, so that
    /// what was not delivered is carried into the next push instead of being lost. Lengths must match.
    pub fn credit(&mut self, undelivered: &[f32]) -> Result<(), CodecError> {
        if undelivered.len() != self.residual.len() {
            return Err(CodecError::LengthMismatch {
                expected: self.residual.len() as u64,
                found: undelivered.len() as u64,
            });
        }
        for (r, &d) in self.residual.iter_mut().zip(undelivered) {
            *r += d;
        }
        Ok(())
    }

    /// Zeroes the residual (e.g. after the worker rejoins with fresh parameters).
    pub fn reset(&mut self) {
        self.residual.fill(0.0);
    }

    /// [`ErrorFeedback::encode`] with `grad` as its scratch, so no buffer of the range's size is kept: on return
    /// `grad` holds `grad + r`, the values encoded. Bit for bit the same frame and residual as `encode`. On an
    /// encode error `r` is unchanged and `out` empty; should decoding its own frame fail (a codec bug), nothing was
    /// delivered, so `r ← grad + r` carries the whole sum, and the error is returned with `out` empty.
    pub fn encode_in_place(
        &mut self,
        enc: &mut Encoder,
        grad: &mut [f32],
        seed: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        self.check_len(grad.len(), out)?;
        for (g, &r) in grad.iter_mut().zip(&self.residual) {
            *g += r;
        }
        enc.encode(grad, seed, out)?;
        // The residual's old values are in `grad` now; it receives the decoded frame, then the difference.
        if let Err(e) = enc.decode_last(out, &mut self.residual) {
            out.clear();
            self.residual.copy_from_slice(grad);
            return Err(e);
        }
        for (r, &s) in self.residual.iter_mut().zip(grad.iter()) {
            *r = s - *r;
        }
        Ok(())
    }

    /// Encodes `grad + r` with `enc` into `out`, then sets `r ← (grad + r) − decode(out)`. On error `r` is unchanged
    /// and `out` is empty.
    pub fn encode(
        &mut self,
        enc: &mut Encoder,
        grad: &[f32],
        seed: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        let n = self.check_len(grad.len(), out)?;
        self.sum.resize(n, 0.0);
        self.decoded.resize(n, 0.0);
        for ((s, &g), &r) in self.sum.iter_mut().zip(grad).zip(&self.residual) {
            *s = g + r;
        }
        enc.encode(&self.sum, seed, out)?;
        if let Err(e) = enc.decode_last(out, &mut self.decoded) {
            out.clear();
            return Err(e);
        }
        for ((r, &s), &d) in self.residual.iter_mut().zip(&self.sum).zip(&self.decoded) {
            *r = s - d;
        }
        Ok(())
    }
}
