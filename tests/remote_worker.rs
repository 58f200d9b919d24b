//! The embedded worker API the Python package wraps ([`RemoteWorker`]), against real `tether-server` processes on
//! loopback: shards read a model file (`[model] kind = "file"`) and start from its weights; two remote workers
//! compute MLP gradients themselves from what they pull and push them; the run reaches the accuracy floor of the
//! built-in worker on the same data. A worker whose model file differs is refused with the layout code, and calls
//! after close are typed errors.

mod support;

use std::path::Path;
use std::time::Duration;

use support::{Cluster, Spec};
use tether::common::config::Config;
use tether::common::layout::{mlp_layout, read_model_file, write_model_file, Layout};
use tether::common::protocol::ErrorCode;
use tether::worker::data::{digits, Partition};
use tether::worker::model::{accuracy, Mlp};
use tether::worker::{Model, RemoteOptions, RemoteWorker, UpdateKind, WorkerError};

const DIMS: [usize; 3] = [64, 32, 10];

/// Writes the MLP's layout with `seed`'s initial values as a model file.
fn write_mlp_file(path: &Path, seed: u64) {
    let layout = mlp_layout(&DIMS);
    let values = layout.init_all(seed);
    let tensors: Vec<(&str, &[usize], &[f32])> = layout
        .tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (
                t.name.as_str(),
                t.shape.as_slice(),
                &values[layout.tensor_range(i)],
            )
        })
        .collect();
    write_model_file(path, &tensors).unwrap();
}

/// The cluster's config with the model read from `file`.
fn file_config(c: &Cluster, file: &Path) -> std::path::PathBuf {
    let text = std::fs::read_to_string(c.path("cluster.toml")).unwrap();
    let text = text.replace(
        "kind = \"mlp\"",
        &format!("kind = \"file\"\nfile = \"{}\"", file.display()),
    );
    let path = c.path("cluster-file.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn remote(cfg: &Config, layout: &Layout, rank: u32, certs: &Path) -> RemoteWorker {
    let opts = RemoteOptions::new(
        cfg.clone(),
        layout.clone(),
        rank,
        certs,
        Duration::from_secs(20),
    )
    .unwrap();
    RemoteWorker::start(opts).unwrap()
}

#[test]
fn remote_workers_train_a_model_file_to_the_built_in_floor() {
    let _guard = support::serial();
    let c = Cluster::new(Spec {
        epochs: 30,
        ..Spec::default()
    });
    write_mlp_file(&c.path("model.safetensors"), 7);
    let config_path = file_config(&c, &c.path("model.safetensors"));
    // The shards read the same file: start them on the file config.
    std::fs::copy(&config_path, c.path("cluster.toml")).unwrap();
    let mut servers = c.servers(&[]);
    let cfg = Config::load(&config_path).unwrap();
    let layout = read_model_file(&c.path("model.safetensors")).unwrap();
    let (train, test) = digits().unwrap();
    let steps = c.steps_per_worker();
    let batch = c.spec.batch;
    // Both workers pull once before either pushes, so both first pulls see the shards' initial weights (a later
    // joiner gets the current weights instead, as it should).
    let first_pulls = std::sync::Barrier::new(2);
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2u32)
            .map(|rank| {
                let (cfg, layout, train, certs) = (&cfg, &layout, &train, c.path("certs"));
                let first_pulls = &first_pulls;
                scope.spawn(move || {
                    let mut w = remote(cfg, layout, rank, &certs);
                    let mut model = Mlp::new(DIMS[0], &DIMS[1..2], DIMS[2]);
                    // Same names and shapes as the model file (only the initial values differ).
                    let spec = |l: &Layout| -> Vec<(String, Vec<usize>)> {
                        l.tensors()
                            .iter()
                            .map(|t| (t.name.clone(), t.shape.clone()))
                            .collect()
                    };
                    assert_eq!(spec(model.layout()), spec(layout));
                    let part = Partition::new(train.len(), rank, 2, cfg.train.seed).unwrap();
                    let mut params = vec![0.0f32; layout.len()];
                    let mut grad = vec![0.0f32; layout.len()];
                    let (mut x, mut y) = (Vec::new(), Vec::new());
                    let mut first = None;
                    for step in 0..steps {
                        w.pull(&mut params).unwrap();
                        if first.is_none() {
                            first = Some(params.clone());
                            first_pulls.wait();
                        }
                        let order = part.epoch_order(step * batch as u64 / part.len() as u64);
                        let at = (step as usize * batch) % part.len();
                        x.clear();
                        y.clear();
                        for &i in order.iter().cycle().skip(at).take(batch) {
                            x.extend_from_slice(train.row(i));
                            y.push(train.y[i]);
                        }
                        let loss = model.loss_and_grad(&params, &x, &y, &mut grad);
                        assert!(w.push(&grad, Some(loss), UpdateKind::Gradient, 1).unwrap());
                    }
                    w.pull(&mut params).unwrap();
                    let report = w.close(Duration::from_secs(20)).unwrap();
                    // After close every call is a typed error, not a panic.
                    assert!(matches!(w.pull(&mut params), Err(WorkerError::Closed)));
                    (first.unwrap(), params, report)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Every worker started from the model file's weights.
    let given = read_model_file(&c.path("model.safetensors"))
        .unwrap()
        .init_all(0);
    for (first, _, _) in &results {
        assert_eq!(
            first, &given,
            "the first pull returns the model file's weights"
        );
    }
    let mut model = Mlp::new(DIMS[0], &DIMS[1..2], DIMS[2]);
    for (rank, (_, last, report)) in results.iter().enumerate() {
        let acc = accuracy(&mut model, last, &test.x, &test.y, 256);
        eprintln!(
            "rank {rank}: accuracy {acc:.4}, {} pushes, {} refused, {:.1}x fewer push bytes than fp32",
            report.pushes,
            report.pushes_refused,
            report.fp32_bytes_pushed as f64 / report.wire_bytes_pushed as f64
        );
        assert_eq!(report.pushes, steps);
        assert_eq!(report.pushes_refused, 0);
        // q4 pushes: about 8x fewer bytes than f32.
        assert!(report.fp32_bytes_pushed > 6 * report.wire_bytes_pushed);
        // The per-step floor of the built-in worker on digits (tests/e2e.rs).
        assert!(acc >= 0.90, "rank {rank}: accuracy {acc} below 0.90");
    }
    // The shards exit once both ranks said goodbye, writing their reports.
    for s in servers.iter_mut() {
        s.wait_success(Duration::from_secs(30));
    }
    for k in 0..2 {
        let r = c.report(&format!("server-{k}.json"));
        assert_eq!(
            support::num(&r, "updates_applied") as u64,
            2 * steps,
            "shard {k}"
        );
    }
}

#[test]
fn a_worker_with_another_model_file_is_refused_with_the_layout_code() {
    let _guard = support::serial();
    let c = Cluster::new(Spec::default());
    write_mlp_file(&c.path("model.safetensors"), 7);
    write_mlp_file(&c.path("other.safetensors"), 8);
    let config_path = file_config(&c, &c.path("model.safetensors"));
    std::fs::copy(&config_path, c.path("cluster.toml")).unwrap();
    let _server = c.server(0, &[]);
    let _server1 = c.server(1, &[]);
    let cfg = Config::load(&config_path).unwrap();
    let other = read_model_file(&c.path("other.safetensors")).unwrap();
    let w = remote(&cfg, &other, 0, &c.path("certs"));
    let mut params = vec![0.0; other.len()];
    let err = w.pull(&mut params).unwrap_err();
    let (_, code, message) = err
        .refusal()
        .unwrap_or_else(|| panic!("not a refusal: {err}"));
    assert_eq!(code, ErrorCode::BadLayoutHash, "{message}");
    // The session is over; later calls say so instead of hanging.
    assert!(matches!(w.pull(&mut params), Err(WorkerError::Ended(_))));
    // A wrong-length buffer is refused before anything is sent.
    let mut ok = remote(
        &cfg,
        &read_model_file(&c.path("model.safetensors")).unwrap(),
        1,
        &c.path("certs"),
    );
    assert!(matches!(
        ok.push(&[0.0; 3], None, UpdateKind::Gradient, 1),
        Err(WorkerError::UpdateLength { got: 3, .. })
    ));
    ok.close(Duration::from_secs(5)).unwrap();
}
