//! The residual policy for pushes a shard did not apply: with error feedback, crediting an undelivered frame back
//! restores the residual to `g + r` (nothing undelivered is lost), so the next push carries it; without error
//! feedback it is a no-op.

use tether_common::codec::{CodecConfig, Decoder, Scheme};
use tether_worker::model::Mlp;
use tether_worker::step::StepEngine;

fn engine(error_feedback: bool) -> (StepEngine, Vec<f32>, Vec<f32>, Vec<u32>) {
    let model = Mlp::new(8, &[6], 3);
    let n = tether_worker::model::Model::layout(&model).len();
    let ranges = vec![0..n / 2, n / 2..n];
    let codec = CodecConfig {
        scheme: Scheme::Q4,
        ..CodecConfig::default()
    };
    let e = StepEngine::new(Box::new(model), 0, ranges, codec, error_feedback, 0.0).unwrap();
    let params: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin() * 0.3).collect();
    let x: Vec<f32> = (0..4 * 8).map(|i| ((i as f32) * 0.11).cos()).collect();
    let y = vec![0, 1, 2, 1];
    (e, params, x, y)
}

#[test]
fn an_undelivered_frame_goes_back_into_the_residual() {
    let (mut e, params, x, y) = engine(true);
    let out = e.compute(0, &params, &x, &y);
    assert!(out.finite);
    let mut frame = Vec::new();
    let r0 = e.residual(1).to_vec();
    assert!(r0.iter().all(|v| *v == 0.0));
    let g: Vec<f32> = e.grad()[e.grad().len() / 2..].to_vec();
    e.encode_shard(1, 0, &mut frame).unwrap();
    let r1 = e.residual(1).to_vec();
    let mut decoded = vec![0.0f32; g.len()];
    Decoder::new(g.len()).decode(&frame, &mut decoded).unwrap();
    // The encode left r1 = g − decode(frame) behind ...
    for i in 0..g.len() {
        assert!(
            (r1[i] - (g[i] - decoded[i])).abs() <= 1e-6,
            "residual after encode at {i}"
        );
    }
    // ... and the credit of the undelivered frame restores g + r0: the whole step is carried forward.
    e.credit_undelivered(1, &frame).unwrap();
    for i in 0..g.len() {
        assert!(
            (e.residual(1)[i] - (g[i] + r0[i])).abs() <= 1e-6,
            "residual after credit at {i}"
        );
    }
    // Shard 0's residual is untouched by shard 1's refusal.
    assert!(e.residual(0).iter().all(|v| *v == 0.0));
    // A frame of the wrong length is refused without changing anything.
    let before = e.residual(1).to_vec();
    let mut other = Vec::new();
    e.encode_shard(0, 1, &mut other).unwrap();
    let r0_after = e.residual(0).to_vec();
    if e.residual(0).len() != e.residual(1).len() {
        assert!(e.credit_undelivered(1, &other).is_err());
    }
    assert_eq!(e.residual(1), &before[..]);
    assert_eq!(e.residual(0), &r0_after[..]);
}

#[test]
fn without_error_feedback_a_refused_update_is_dropped() {
    let (mut e, params, x, y) = engine(false);
    e.compute(0, &params, &x, &y);
    let mut frame = Vec::new();
    e.encode_shard(0, 0, &mut frame).unwrap();
    e.credit_undelivered(0, &frame).unwrap();
    assert!(e.residual(0).is_empty());
}

#[test]
fn a_rollback_clears_the_residuals_of_the_shards_that_rolled_back() {
    let (mut e, params, x, y) = engine(true);
    assert!(e.compute(0, &params, &x, &y).finite);
    let mut frame = Vec::new();
    for k in 0..2 {
        e.encode_shard(k, 0, &mut frame).unwrap();
        assert!(
            e.residual(k).iter().any(|v| *v != 0.0),
            "q4 leaves a residual"
        );
    }
    let kept = e.residual(0).to_vec();
    e.reset_trajectory(&[1]);
    assert!(e.residual(1).iter().all(|v| *v == 0.0));
    assert_eq!(e.residual(0), kept.as_slice(), "shard 0 did not roll back");
}

#[test]
fn a_push_fault_scales_the_update_past_the_clip() {
    use tether_worker::step::GradientFault;
    let model = Mlp::new(8, &[6], 3);
    let n = tether_worker::model::Model::layout(&model).len();
    let codec = CodecConfig::default();
    let ranges = vec![0..n / 2, n / 2..n];
    let mut e = StepEngine::new(Box::new(model), 0, ranges, codec, false, 0.5)
        .unwrap()
        .with_faults(vec![GradientFault::PushScaleAt(3, 100.0)]);
    let params: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin()).collect();
    let x: Vec<f32> = (0..4 * 8)
        .map(|i| ((i as f32) * 0.11).cos() * 5.0)
        .collect();
    let y = vec![0, 1, 2, 1];
    let norm = |g: &[f32]| g.iter().map(|v| v * v).sum::<f32>().sqrt();
    e.compute(2, &params, &x, &y);
    e.fault_push(2..3);
    assert!(norm(e.grad()) <= 0.5 + 1e-4, "clipped, no fault at step 2");
    e.compute(3, &params, &x, &y);
    e.fault_push(3..4);
    assert!(norm(e.grad()) > 40.0, "the fault scales the clipped update");
}

#[test]
fn a_rollback_restarts_the_inner_optimizer_of_local_step_rounds() {
    use tether_common::config::{OptimizerConfig, OptimizerKind};
    let inner = OptimizerConfig {
        kind: OptimizerKind::Adam,
        lr: 1e-2,
        ..OptimizerConfig::default()
    };
    let (used, params, x, y) = engine(true);
    let mut used = used.with_inner(&inner);
    let mut theta = params.clone();
    for step in 0..5 {
        used.compute(step, &theta, &x, &y);
        used.inner_step(&mut theta);
    }
    let (fresh, _, _, _) = engine(true);
    let mut fresh = fresh.with_inner(&inner);
    // After the reset, one inner step from the same point equals a fresh optimizer's first step, bit for bit.
    used.reset_trajectory(&[]);
    let (mut a, mut b) = (params.clone(), params.clone());
    used.compute(9, &a, &x, &y);
    used.inner_step(&mut a);
    fresh.compute(9, &b, &x, &y);
    fresh.inner_step(&mut b);
    assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
    // Without the reset the accumulated moments make it differ.
    let (again, _, _, _) = engine(true);
    let mut again = again.with_inner(&inner);
    let mut t = params.clone();
    for step in 0..5 {
        again.compute(step, &t, &x, &y);
        again.inner_step(&mut t);
    }
    let mut c = params.clone();
    again.compute(9, &c, &x, &y);
    again.inner_step(&mut c);
    assert!(c.iter().zip(&b).any(|(p, q)| p.to_bits() != q.to_bits()));
}
