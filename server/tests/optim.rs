//! The optimizers against independent f64 reference implementations, the schedules at hand-derived points,
//! determinism, and checkpoint-style restore.

use tether_common::config::{OptimizerConfig, OptimizerKind, Schedule};
use tether_server::optim::{OptimError, Optimizer};

const ALL: [OptimizerKind; 6] = [
    OptimizerKind::Sgd,
    OptimizerKind::Momentum,
    OptimizerKind::Nesterov,
    OptimizerKind::Adam,
    OptimizerKind::Adamw,
    OptimizerKind::Adagrad,
];

/// Not a multiple of the 8-lane chunk, so both the vector loop and the remainder run.
const LEN: usize = 37;

fn cfg(kind: OptimizerKind, wd: f32) -> OptimizerConfig {
    OptimizerConfig {
        kind,
        lr: 0.05,
        momentum: 0.9,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: wd,
        schedule: Schedule::Constant,
        staleness_aware: false,
        ..OptimizerConfig::default()
    }
}

fn init_weights(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i as f32) * 0.37).cos() * 0.8).collect()
}

/// Gradients of varied sign and magnitude that change every step.
fn grad_at(n: usize, t: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32) * 0.7 + (t as f32) * 1.3).sin() * (1.0 + (i % 3) as f32) * 0.1)
        .collect()
}

/// Straightforward f64 implementation written from the textbook formulas.
struct Reference {
    c: OptimizerConfig,
    w: Vec<f64>,
    a: Vec<f64>,
    b: Vec<f64>,
    t: i32,
}

impl Reference {
    fn new(c: &OptimizerConfig, w: &[f32]) -> Self {
        Self {
            c: c.clone(),
            w: w.iter().map(|&x| f64::from(x)).collect(),
            a: vec![0.0; w.len()],
            b: vec![0.0; w.len()],
            t: 0,
        }
    }

    fn step(&mut self, g: &[f32], lr: f64) {
        self.t += 1;
        let c = &self.c;
        let (mu, b1, b2) = (
            f64::from(c.momentum),
            f64::from(c.beta1),
            f64::from(c.beta2),
        );
        let (eps, wd) = (f64::from(c.eps), f64::from(c.weight_decay));
        for i in 0..self.w.len() {
            let g = f64::from(g[i]);
            let w = self.w[i];
            let gl2 = g + wd * w;
            self.w[i] = match c.kind {
                OptimizerKind::Sgd => w - lr * gl2,
                OptimizerKind::Momentum => {
                    self.a[i] = mu * self.a[i] + gl2;
                    w - lr * self.a[i]
                }
                OptimizerKind::Nesterov => {
                    self.a[i] = mu * self.a[i] + gl2;
                    w - lr * (gl2 + mu * self.a[i])
                }
                OptimizerKind::Adam | OptimizerKind::Adamw => {
                    let decoupled = c.kind == OptimizerKind::Adamw;
                    let (w, g) = if decoupled {
                        (w - lr * wd * w, g)
                    } else {
                        (w, gl2)
                    };
                    self.a[i] = b1 * self.a[i] + (1.0 - b1) * g;
                    self.b[i] = b2 * self.b[i] + (1.0 - b2) * g * g;
                    let m_hat = self.a[i] / (1.0 - b1.powi(self.t));
                    let v_hat = self.b[i] / (1.0 - b2.powi(self.t));
                    w - lr * m_hat / (v_hat.sqrt() + eps)
                }
                OptimizerKind::Adagrad => {
                    self.a[i] += gl2 * gl2;
                    w - lr * gl2 / (self.a[i].sqrt() + eps)
                }
            };
        }
    }
}

fn assert_close(what: &str, got: &[f32], want: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(
            err <= rel * w.abs().max(1e-3),
            "{what}[{i}]: got {g}, reference {w} (error {err:e})"
        );
    }
}

fn check_against_reference(kind: OptimizerKind, wd: f32) {
    let c = cfg(kind, wd);
    let mut w = init_weights(LEN);
    let mut reference = Reference::new(&c, &w);
    let mut opt = Optimizer::new(&c, LEN);
    for t in 0..8 {
        let g = grad_at(LEN, t);
        opt.step(&mut w, &g, 1.0);
        reference.step(&g, f64::from(c.lr));
        assert_close(
            &format!("{kind:?} wd={wd} step {t} weights"),
            &w,
            &reference.w,
            1e-5,
        );
    }
    assert_eq!(opt.steps(), 8);
    let slots = opt.slots();
    match kind {
        OptimizerKind::Sgd => assert!(slots.is_empty()),
        OptimizerKind::Adam | OptimizerKind::Adamw => {
            assert_eq!(slots.len(), 2);
            assert_close(&format!("{kind:?} m"), &slots[0], &reference.a, 1e-5);
            assert_close(&format!("{kind:?} v"), &slots[1], &reference.b, 1e-5);
        }
        _ => {
            assert_eq!(slots.len(), 1);
            assert_close(&format!("{kind:?} slot"), &slots[0], &reference.a, 1e-5);
        }
    }
}

#[test]
fn every_optimizer_matches_the_f64_reference_without_weight_decay() {
    for kind in ALL {
        check_against_reference(kind, 0.0);
    }
}

#[test]
fn every_optimizer_matches_the_f64_reference_with_weight_decay() {
    for kind in ALL {
        check_against_reference(kind, 0.1);
    }
}

#[test]
fn adam_and_adamw_differ_when_weight_decay_is_set() {
    let (mut wa, mut ww) = (init_weights(LEN), init_weights(LEN));
    let mut adam = Optimizer::new(&cfg(OptimizerKind::Adam, 0.1), LEN);
    let mut adamw = Optimizer::new(&cfg(OptimizerKind::Adamw, 0.1), LEN);
    for t in 0..3 {
        let g = grad_at(LEN, t);
        adam.step(&mut wa, &g, 1.0);
        adamw.step(&mut ww, &g, 1.0);
    }
    assert!(wa.iter().zip(&ww).any(|(a, b)| (a - b).abs() > 1e-4));
}

#[test]
fn lr_scale_multiplies_the_step() {
    for kind in ALL {
        let c = cfg(kind, 0.05);
        let mut w = init_weights(LEN);
        let mut reference = Reference::new(&c, &w);
        let mut opt = Optimizer::new(&c, LEN);
        for (t, scale) in [1.0f32, 0.5, 0.25, 1.0, 1.0 / 3.0].into_iter().enumerate() {
            let g = grad_at(LEN, t);
            opt.step(&mut w, &g, scale);
            reference.step(&g, f64::from(c.lr) * f64::from(scale));
        }
        assert_close(&format!("{kind:?} scaled"), &w, &reference.w, 1e-5);
    }
}

#[test]
fn warmup_cosine_schedule_at_hand_derived_points() {
    let c = OptimizerConfig {
        lr: 1.0,
        schedule: Schedule::WarmupCosine {
            warmup: 10,
            total: 110,
            min_ratio: 0.1,
        },
        ..OptimizerConfig::default()
    };
    let opt = Optimizer::new(&c, 0);
    let near = |t: u64, want: f64| {
        let got = f64::from(opt.lr_at(t));
        assert!(
            (got - want).abs() <= 1e-6 * want.max(1e-3),
            "lr_at({t}) = {got}, want {want}"
        );
    };
    near(0, 0.0); // warmup starts from 0
    near(1, 0.1);
    near(5, 0.5);
    near(9, 0.9);
    near(10, 1.0); // warmup end: full lr
    near(35, 0.868_198_051_533_946_4); // quarter of the cosine: 0.1 + 0.45·(1 + cos(π/4))
    near(60, 0.55); // cosine midpoint: halfway between 1 and the floor
    near(110, 0.1); // end of the cosine: the floor
    near(10_000, 0.1);
}

#[test]
fn step_schedule_at_boundaries() {
    let c = OptimizerConfig {
        lr: 0.2,
        schedule: Schedule::Step {
            every: 100,
            gamma: 0.5,
        },
        ..OptimizerConfig::default()
    };
    let opt = Optimizer::new(&c, 0);
    let near = |t: u64, want: f64| {
        let got = f64::from(opt.lr_at(t));
        assert!(
            (got - want).abs() <= 1e-6 * want,
            "lr_at({t}) = {got}, want {want}"
        );
    };
    near(1, 0.2);
    near(99, 0.2);
    near(100, 0.1);
    near(199, 0.1);
    near(200, 0.05);
    near(1000, 0.2 / 1024.0);
    let never = Optimizer::new(
        &OptimizerConfig {
            schedule: Schedule::Step {
                every: 0,
                gamma: 0.5,
            },
            ..c
        },
        0,
    );
    assert_eq!(never.lr_at(12345), 0.2);
}

#[test]
fn step_uses_the_scheduled_lr_of_its_one_based_update_number() {
    let c = OptimizerConfig {
        kind: OptimizerKind::Sgd,
        lr: 1.0,
        weight_decay: 0.0,
        schedule: Schedule::WarmupCosine {
            warmup: 4,
            total: 100,
            min_ratio: 0.0,
        },
        ..OptimizerConfig::default()
    };
    let mut opt = Optimizer::new(&c, 1);
    let mut w = [0.0f32];
    for t in 1..=4u64 {
        let before = w[0];
        opt.step(&mut w, &[1.0], 1.0);
        let applied = f64::from(before - w[0]);
        assert!(
            (applied - t as f64 / 4.0).abs() < 1e-6,
            "update {t} applied lr {applied}"
        );
    }
}

fn run(kind: OptimizerKind, n: usize, steps: usize, portable: bool) -> (Vec<f32>, Optimizer) {
    let mut opt = Optimizer::new(&cfg(kind, 0.01), n);
    if portable {
        opt = opt.with_portable_kernels();
    }
    let mut w = init_weights(n);
    for t in 0..steps {
        opt.step(&mut w, &grad_at(n, t), 1.0);
    }
    (w, opt)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn two_runs_are_bit_identical() {
    for kind in ALL {
        let (w1, o1) = run(kind, 1001, 6, false);
        let (w2, o2) = run(kind, 1001, 6, false);
        assert_eq!(bits(&w1), bits(&w2), "{kind:?}");
        for (a, b) in o1.slots().iter().zip(o2.slots()) {
            assert_eq!(bits(a), bits(b), "{kind:?} slots");
        }
    }
}

#[test]
fn portable_and_simd_kernels_are_bit_identical() {
    for kind in ALL {
        let (w1, o1) = run(kind, 1003, 6, false);
        let (w2, o2) = run(kind, 1003, 6, true);
        assert_eq!(bits(&w1), bits(&w2), "{kind:?}");
        for (a, b) in o1.slots().iter().zip(o2.slots()) {
            assert_eq!(bits(a), bits(b), "{kind:?} slots");
        }
    }
}

#[test]
fn restore_then_continue_equals_an_uninterrupted_run() {
    for kind in ALL {
        let c = cfg(kind, 0.01);
        let (whole_w, whole) = run(kind, LEN, 10, false);

        let (mut w, first) = run(kind, LEN, 4, false);
        let mut resumed = Optimizer::new(&c, LEN);
        resumed
            .restore(first.steps(), first.slots().to_vec())
            .expect("restore");
        assert_eq!(resumed.steps(), 4);
        for t in 4..10 {
            resumed.step(&mut w, &grad_at(LEN, t), 1.0);
        }
        assert_eq!(bits(&w), bits(&whole_w), "{kind:?} weights");
        assert_eq!(resumed.steps(), whole.steps());
        for (a, b) in resumed.slots().iter().zip(whole.slots()) {
            assert_eq!(bits(a), bits(b), "{kind:?} slots");
        }
    }
}

#[test]
fn restore_rejects_wrong_slot_count_and_lengths() {
    let mut adam = Optimizer::new(&cfg(OptimizerKind::Adam, 0.0), 5);
    assert_eq!(
        adam.restore(3, vec![vec![0.0; 5]]),
        Err(OptimError::SlotCount {
            expected: 2,
            found: 1
        })
    );
    assert_eq!(
        adam.restore(3, vec![vec![0.0; 5], vec![0.0; 4]]),
        Err(OptimError::SlotLength {
            slot: 1,
            expected: 5,
            found: 4
        })
    );
    // A rejected restore leaves the state untouched.
    assert_eq!(adam.steps(), 0);
    assert!(adam.slots().iter().all(|s| s.len() == 5));

    let mut sgd = Optimizer::new(&cfg(OptimizerKind::Sgd, 0.0), 5);
    assert!(matches!(
        sgd.restore(1, vec![vec![0.0; 5]]),
        Err(OptimError::SlotCount {
            expected: 0,
            found: 1
        })
    ));
    let mut momentum = Optimizer::new(&cfg(OptimizerKind::Momentum, 0.0), 5);
    assert!(matches!(
        momentum.restore(1, vec![vec![0.0; 6]]),
        Err(OptimError::SlotLength { slot: 0, .. })
    ));
    assert_eq!(momentum.restore(7, vec![vec![1.0; 5]]), Ok(()));
    assert_eq!(momentum.steps(), 7);
}

#[test]
fn state_footprint_per_kind() {
    let bpp = |k| Optimizer::new(&cfg(k, 0.0), 3).bytes_per_param();
    assert_eq!(bpp(OptimizerKind::Sgd), 0);
    assert_eq!(bpp(OptimizerKind::Momentum), 4);
    assert_eq!(bpp(OptimizerKind::Nesterov), 4);
    assert_eq!(bpp(OptimizerKind::Adagrad), 4);
    assert_eq!(bpp(OptimizerKind::Adam), 8);
    assert_eq!(bpp(OptimizerKind::Adamw), 8);
}

#[test]
#[should_panic(expected = "gradient length")]
fn step_with_a_gradient_of_the_wrong_length_panics() {
    let mut opt = Optimizer::new(&cfg(OptimizerKind::Adam, 0.0), 4);
    let mut w = [0.0f32; 4];
    opt.step(&mut w, &[0.0; 3], 1.0);
}

#[test]
fn try_step_applies_exactly_what_step_applies_on_both_kernel_paths() {
    for kind in ALL {
        for portable in [false, true] {
            let c = cfg(kind, 0.1);
            let (mut a, mut b) = (Optimizer::new(&c, LEN), Optimizer::new(&c, LEN));
            if portable {
                a = a.with_portable_kernels();
                b = b.with_portable_kernels();
            }
            let (mut wa, mut wb) = (init_weights(LEN), init_weights(LEN));
            for t in 0..6 {
                let g = grad_at(LEN, t);
                a.step(&mut wa, &g, 0.5);
                b.try_step(&mut wb, &g, 0.5).unwrap();
            }
            assert_eq!(bits(&wa), bits(&wb), "{kind:?} portable={portable}");
            assert_eq!(a.steps(), b.steps());
            for (sa, sb) in a.slots().iter().zip(b.slots()) {
                assert_eq!(bits(sa), bits(sb), "{kind:?} portable={portable}");
            }
        }
    }
}

#[test]
fn try_step_refuses_an_update_that_overflows_and_changes_nothing() {
    for kind in ALL {
        for portable in [false, true] {
            let mut c = cfg(kind, 0.0);
            // lr 2 makes SGD's w − lr·g overflow for g = f32::MAX in one step, as momentum's and Adam's do.
            c.lr = 2.0;
            let mut opt = Optimizer::new(&c, LEN);
            if portable {
                opt = opt.with_portable_kernels();
            }
            let mut w = init_weights(LEN);
            opt.step(&mut w, &grad_at(LEN, 0), 1.0);
            let (w0, slots0, steps0) = (bits(&w), opt.slots().to_vec(), opt.steps());
            let mut g = grad_at(LEN, 1);
            // The last element: the scalar remainder of the vector loop must be checked too.
            g[LEN - 1] = f32::MAX;
            assert_eq!(
                opt.try_step(&mut w, &g, 1.0),
                Err(OptimError::NonFiniteState),
                "{kind:?} portable={portable}"
            );
            assert_eq!(bits(&w), w0, "{kind:?}");
            assert_eq!(opt.steps(), steps0, "{kind:?}");
            for (s, s0) in opt.slots().iter().zip(&slots0) {
                assert_eq!(bits(s), bits(s0), "{kind:?}");
            }
            // A finite update afterwards goes through.
            opt.try_step(&mut w, &grad_at(LEN, 2), 1.0).unwrap();
            assert_eq!(opt.steps(), steps0 + 1);
        }
    }
}

#[test]
fn exempt_ranges_step_without_weight_decay_and_the_rest_with_it() {
    // Exempt 3..9 and 20..37 (given unsorted and overlapping): each part must equal an optimizer of its own with
    // (outside) or without (inside) weight decay, bit for bit, slots included; try_step agrees with step.
    let parts = [(0..3, true), (3..9, false), (9..20, true), (20..LEN, false)];
    for kind in ALL {
        let mut w = init_weights(LEN);
        let mut opt =
            Optimizer::new(&cfg(kind, 0.1), LEN).with_decay_exempt(vec![20..40, 3..7, 5..9]);
        assert_eq!(opt.decay_exempt(), &[3..9, 20..LEN]);
        let mut refs: Vec<(Vec<f32>, Optimizer)> = parts
            .iter()
            .map(|(r, decay)| {
                let wd = if *decay { 0.1 } else { 0.0 };
                (
                    w[r.clone()].to_vec(),
                    Optimizer::new(&cfg(kind, wd), r.len()),
                )
            })
            .collect();
        for t in 0..4 {
            let g = grad_at(LEN, t);
            if t % 2 == 0 {
                opt.step(&mut w, &g, 1.0);
            } else {
                opt.try_step(&mut w, &g, 1.0).unwrap();
            }
            for ((r, _), (rw, ro)) in parts.iter().zip(refs.iter_mut()) {
                ro.step(rw, &g[r.clone()], 1.0);
            }
        }
        for ((r, decay), (rw, ro)) in parts.iter().zip(&refs) {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&w[r.clone()]),
                bits(rw),
                "{kind:?} part {r:?} decay {decay}"
            );
            for (s, rs) in opt.slots().iter().zip(ro.slots()) {
                assert_eq!(bits(&s[r.clone()]), bits(rs), "{kind:?} slots of {r:?}");
            }
        }
    }
}

/// A step on part of the range (a streamed fragment) is, on that part, bit for bit the step a whole-range optimizer
/// takes with the same gradient there (decay exemptions crossing the part's edges included), and leaves weights and
/// state outside the part untouched.
#[test]
fn a_step_on_a_part_equals_the_whole_step_there_and_touches_nothing_else() {
    for kind in ALL {
        let c = cfg(kind, 0.01);
        let exempt = vec![3..9, 20..30];
        let mut whole = Optimizer::new(&c, LEN).with_decay_exempt(exempt.clone());
        let mut parted = Optimizer::new(&c, LEN).with_decay_exempt(exempt);
        let (mut w_whole, mut w_part) = (init_weights(LEN), init_weights(LEN));
        let part = 5..25;
        for t in 0..4 {
            let g = grad_at(LEN, t);
            // The whole optimizer sees zeros outside the part only for comparison of the part; the parted one never
            // sees them.
            whole.step(&mut w_whole, &g, 1.0);
            let before = w_part.clone();
            let slots_before = parted.slots().to_vec();
            parted
                .try_step_part(part.clone(), &mut w_part, &g[part.clone()], 1.0)
                .unwrap();
            assert_eq!(
                bits(&w_part[..part.start]),
                bits(&before[..part.start]),
                "{kind:?}"
            );
            assert_eq!(
                bits(&w_part[part.end..]),
                bits(&before[part.end..]),
                "{kind:?}"
            );
            for (s, b) in parted.slots().iter().zip(&slots_before) {
                assert_eq!(bits(&s[..part.start]), bits(&b[..part.start]), "{kind:?}");
                assert_eq!(bits(&s[part.end..]), bits(&b[part.end..]), "{kind:?}");
            }
            assert_eq!(
                bits(&w_part[part.clone()]),
                bits(&w_whole[part.clone()]),
                "{kind:?} t={t}"
            );
            // Keep the two in step outside the part for the next comparison.
            w_part = w_whole.clone();
            let _ = parted.restore(parted.steps(), whole.slots().to_vec());
        }
        assert_eq!(parted.steps(), 4);
    }
}
