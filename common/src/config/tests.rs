//! The configuration's contract: defaults (serde's path and the sections' `Default` cannot diverge), path
//! resolution, unknown keys named in every section, and values refused by validation naming their key.

use std::path::{Path, PathBuf};

use super::*;
use crate::codec::Scheme;

#[test]
fn minimal_file_gets_defaults_and_resolves_paths() {
    let cfg = Config::parse(
        "[cluster]\nservers = [\"127.0.0.1:7000\"]\n",
        Path::new("/etc/tether"),
    )
    .unwrap();
    assert_eq!(cfg.cluster.workers, 4);
    assert_eq!(cfg.cluster.staleness, Staleness::Bounded(3));
    assert_eq!(cfg.cluster.tls_dir, PathBuf::from("/etc/tether/certs"));
    assert_eq!(cfg.checkpoint.dir, PathBuf::from("/etc/tether/ckpt"));
    assert_eq!(cfg.data.path, default_data_dir());
    assert_eq!(cfg.compression.scheme, Scheme::Q4);
    assert_eq!(cfg.optimizer.kind, OptimizerKind::Adam);
    assert_eq!(cfg.model.hidden, vec![256, 128]);
}

#[test]
fn a_model_file_is_required_for_kind_file_and_resolves_against_the_config() {
    let cfg = Config::parse(
        "[cluster]\nservers = [\"127.0.0.1:7000\"]\n[model]\nkind = \"file\"\nfile = \"m.safetensors\"\n",
        Path::new("/etc/tether"),
    )
    .unwrap();
    assert_eq!(cfg.model.kind, ModelKind::File);
    assert_eq!(
        cfg.model.file.as_deref(),
        Some(Path::new("/etc/tether/m.safetensors"))
    );
    let err = Config::parse(
        "[cluster]\nservers = [\"127.0.0.1:7000\"]\n[model]\nkind = \"file\"\n",
        Path::new("/etc/tether"),
    )
    .unwrap_err();
    assert!(err.to_string().contains("model.file"), "{err}");
    // The layout comes from the file; a missing one is a typed error naming it, not a panic.
    let err = crate::layout::model_layout(&cfg).unwrap_err();
    assert!(err.to_string().contains("m.safetensors"), "{err}");
}

#[test]
fn design_doc_example_parses() {
    let text = r#"
[cluster]
servers = ["127.0.0.1:7000", "127.0.0.1:7001"]
workers = 4
staleness = 3
worker_timeout_ms = 5000
tls_dir = "certs"
[model]
kind = "mlp"
hidden = [256, 128]
seed = 42
[data]
dataset = "fashion-mnist"
path = "/usr/share/datasets/fashion-mnist"
[train]
batch = 128
epochs = 5
eval_every = 200
[optimizer]
kind = "adam"
lr = 1e-3
[compression]
scheme = "q4"
bucket = 512
error_feedback = true
zstd = true
[checkpoint]
dir = "ckpt"
every_updates = 500
keep = 3
"#;
    let cfg = Config::parse(text, Path::new("/x")).unwrap();
    assert_eq!(cfg.cluster.servers.len(), 2);
    assert!(cfg.compression.zstd);
}

#[test]
fn staleness_accepts_inf_and_numbers_only() {
    let p = |s: &str| {
        Config::parse(
            &format!("[cluster]\nservers=[\"a:1\"]\nstaleness={s}\n"),
            Path::new("/"),
        )
    };
    assert_eq!(
        p("\"inf\"").unwrap().cluster.staleness,
        Staleness::Unbounded
    );
    assert_eq!(p("0").unwrap().cluster.staleness, Staleness::Bounded(0));
    assert!(p("-1").is_err());
    assert!(p("\"soon\"").is_err());
}

#[test]
fn unknown_keys_are_errors_naming_the_key() {
    let e = Config::parse(
        "[cluster]\nservers=[\"a:1\"]\nworkerz = 3\n",
        Path::new("/"),
    )
    .unwrap_err();
    assert!(e.to_string().contains("workerz"), "{e}");
    let e = Config::parse(
        "[cluster]\nservers=[\"a:1\"]\n[optimiser]\nlr=1\n",
        Path::new("/"),
    )
    .unwrap_err();
    assert!(e.to_string().contains("optimiser"), "{e}");
}

#[test]
fn missing_servers_and_bad_values_are_rejected() {
    assert!(Config::parse("[cluster]\nworkers = 2\n", Path::new("/")).is_err());
    let e = Config::parse(
        "[cluster]\nservers=[\"a:1\"]\n[optimizer]\nlr = -1.0\n",
        Path::new("/"),
    )
    .unwrap_err();
    assert!(e.to_string().contains("optimizer.lr"), "{e}");
    assert!(Config::parse(
        "[cluster]\nservers=[\"a:1\"]\n[compression]\nscheme=\"q3\"\n",
        Path::new("/")
    )
    .is_err());
}

#[test]
fn a_progress_deadline_shorter_than_the_eviction_timeout_is_refused_naming_the_key() {
    let e = Config::parse(
        "[cluster]\nservers=[\"a:1\"]\nworker_timeout_ms = 5000\nprogress_timeout_ms = 4999\n",
        Path::new("/"),
    )
    .unwrap_err();
    assert!(e.to_string().contains("cluster.progress_timeout_ms"), "{e}");
    let ok = Config::parse(
        "[cluster]\nservers=[\"a:1\"]\nworker_timeout_ms = 5000\nprogress_timeout_ms = 5000\n",
        Path::new("/"),
    )
    .unwrap();
    assert_eq!(ok.cluster.progress_timeout_ms, 5000);
}

/// One minimal file: the required key only.
const MINIMAL: &str = "[cluster]\nservers = [\"a:1\"]\n";

#[test]
fn missing_keys_and_sections_take_the_default_impls() {
    // An empty base leaves relative defaults (certs, ckpt) as they are, so the parse compares field by field.
    let expected = Config::with_servers(vec!["a:1".into()]);
    assert_eq!(Config::parse(MINIMAL, Path::new("")).unwrap(), expected);
    let empty_sections = format!(
        "{MINIMAL}[model]\n[data]\n[train]\n[optimizer]\n[optimizer.outer]\n[compression]\n[checkpoint]\n\
         [rollback]\n[guard]\n[shard]\n"
    );
    assert_eq!(
        Config::parse(&empty_sections, Path::new("")).unwrap(),
        expected
    );
}

#[test]
fn defaults_written_out_read_back_unchanged() {
    let cfg = Config::with_servers(vec!["a:1".into(), "b:2".into()]);
    let text = toml::to_string(&cfg).unwrap();
    assert_eq!(Config::parse(&text, Path::new("")).unwrap(), cfg, "{text}");
}

#[test]
fn documented_defaults_are_the_default_impls() {
    // The values the field docs state, in one place, against what `Default` builds.
    let c = Config::with_servers(vec!["a:1".into()]);
    let cl = &c.cluster;
    assert_eq!(
        (
            cl.workers,
            cl.staleness,
            cl.worker_timeout_ms,
            cl.heartbeat_ms,
            cl.progress_timeout_ms
        ),
        (4, Staleness::Bounded(3), 5000, 500, 120_000)
    );
    assert_eq!(cl.tls_dir, PathBuf::from("certs"));
    assert!(cl.revoked.is_empty());
    let m = &c.model;
    assert_eq!(
        (m.kind, m.hidden.clone(), m.seed),
        (ModelKind::Mlp, vec![256, 128], 42)
    );
    assert_eq!((m.features, m.classes), (None, None));
    assert_eq!((m.layers, m.heads, m.dim, m.context), (4, 4, 128, 64));
    assert_eq!(c.data.dataset, DatasetKind::FashionMnist);
    assert_eq!(
        (c.data.path.clone(), c.data.test_path.clone()),
        (default_data_dir(), None)
    );
    let t = &c.train;
    assert_eq!(
        (t.batch, t.epochs, t.eval_every, t.clip_norm, t.seed),
        (128, 5, 200, 5.0, 7)
    );
    assert_eq!(
        (t.local_steps, t.max_steps, t.precision),
        (0, 0, ComputePrecision::F32)
    );
    assert_eq!((t.loss_scale, t.loss_scale_window), (65536.0, 200));
    assert_eq!((t.local_steps_max, t.fragments), (0, 1));
    assert_eq!(c.shard.threads, 0);
    let o = &c.optimizer;
    assert_eq!(
        (o.kind, o.lr, o.momentum, o.beta1, o.beta2, o.eps),
        (OptimizerKind::Adam, 1e-3, 0.9, 0.9, 0.999, 1e-8)
    );
    assert_eq!(
        (o.weight_decay, o.schedule, o.staleness_aware),
        (0.0, Schedule::Constant, false)
    );
    assert_eq!(
        (o.outer.kind, o.outer.lr, o.outer.momentum),
        (OptimizerKind::Nesterov, 0.7, 0.5)
    );
    let z = &c.compression;
    assert_eq!(
        (z.scheme, z.bucket, z.error_feedback, z.zstd),
        (Scheme::Q4, 512, true, true)
    );
    assert_eq!(z.rounding, crate::codec::Rounding::Stochastic);
    assert_eq!(
        (z.pull_bf16, z.pull, z.pull_scheme),
        (false, PullKind::Delta, Scheme::Q4)
    );
    assert_eq!(z.keep, 64);
    let k = &c.checkpoint;
    assert_eq!(
        (
            k.dir.clone(),
            k.every_updates,
            k.keep,
            k.url.clone(),
            k.local
        ),
        (PathBuf::from("ckpt"), 500, 3, None, true)
    );
    let r = c.rollback;
    assert_eq!(
        (
            r.enabled,
            r.factor,
            r.rounds,
            r.window,
            r.every,
            r.keep,
            r.lr_scale,
            r.lr_rounds
        ),
        (false, 3.0, 2, 16, 10, 3, 1.0, 0)
    );
}

#[test]
fn unknown_keys_are_errors_naming_the_key_in_every_section() {
    for (section, extra) in [
        ("cluster", ""),
        ("model", "\n[model]"),
        ("data", "\n[data]"),
        ("train", "\n[train]"),
        ("optimizer", "\n[optimizer]"),
        ("optimizer.outer", "\n[optimizer.outer]"),
        (
            "optimizer.schedule",
            "\n[optimizer.schedule]\nkind = \"warmup_cosine\"\nwarmup = 1\ntotal = 2",
        ),
        ("compression", "\n[compression]"),
        ("checkpoint", "\n[checkpoint]"),
        ("rollback", "\n[rollback]"),
        ("guard", "\n[guard]"),
        ("shard", "\n[shard]"),
    ] {
        let text = format!("{MINIMAL}{extra}\nno_such_key_here = 1\n");
        let e = Config::parse(&text, Path::new("/")).unwrap_err();
        assert!(
            matches!(e, ConfigError::Parse { .. }) && e.to_string().contains("no_such_key_here"),
            "[{section}]: {e}"
        );
    }
}

#[test]
fn missing_or_empty_servers_and_zero_workers_are_refused_naming_the_key() {
    for text in ["[cluster]\nworkers = 2\n", "[cluster]\nservers = []\n"] {
        let e = Config::parse(text, Path::new("/")).unwrap_err();
        assert!(e.to_string().contains("cluster.servers"), "{e}");
    }
    let e = Config::parse(&format!("{MINIMAL}workers = 0\n"), Path::new("/")).unwrap_err();
    assert!(
        matches!(
            e,
            ConfigError::Invalid {
                key: "cluster.workers",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("cluster.workers"), "{e}");
}

#[test]
fn a_model_too_large_to_count_or_to_hold_is_refused_naming_the_key() {
    let cases = [
        // 784·2^32 + 2^32·2^32 does not fit in 64 bits.
        ("[model]\nhidden = [4294967296, 4294967296]\n", "model.hidden"),
        // Fits in 64 bits, over the cap.
        ("[model]\nhidden = [1048576, 8192]\n", "model.hidden"),
        (
            "[model]\nkind = \"logreg\"\nfeatures = 9223372036854775807\nclasses = 3\n[data]\ndataset = \"csv\"\n",
            "model.features/classes",
        ),
        (
            "[model]\nkind = \"gpt\"\nlayers = 64\nheads = 8\ndim = 8192\n[data]\ndataset = \"kjv-excerpt\"\n",
            "model.layers/dim/context",
        ),
    ];
    for (section, key) in cases {
        let e = Config::parse(&format!("{MINIMAL}{section}"), Path::new("/")).unwrap_err();
        assert!(
            matches!(&e, ConfigError::Invalid { key: k, .. } if *k == key),
            "{section}: {e}"
        );
    }
    // The largest model under the cap still parses.
    Config::parse(
        &format!("{MINIMAL}[model]\nhidden = [65536, 32768]\n"),
        Path::new("/"),
    )
    .unwrap();
}

#[test]
fn the_guard_is_on_by_default_and_its_keys_are_range_checked() {
    let g = Config::parse(MINIMAL, Path::new("/")).unwrap().guard;
    assert_eq!(
        (g.factor, g.window, g.warmup, g.margin, g.max_norm, g.floor),
        (10.0, 64, 16, 8.0, None, None)
    );
    let cfg = Config::parse(
        &format!("{MINIMAL}[guard]\nfactor = 0\nmax_norm = inf\nfloor = 0.5\n"),
        Path::new("/"),
    )
    .unwrap();
    assert_eq!(
        (cfg.guard.factor, cfg.guard.max_norm, cfg.guard.floor),
        (0.0, Some(f32::INFINITY), Some(0.5))
    );
    for (line, key) in [
        ("factor = 1.0", "guard.factor"),
        ("factor = -2.0", "guard.factor"),
        ("factor = inf", "guard.factor"),
        ("window = 0", "guard.window"),
        ("window = 4097", "guard.window"),
        ("warmup = 0", "guard.warmup"),
        ("warmup = 65", "guard.warmup"),
        ("margin = 0.5", "guard.margin"),
        ("margin = nan", "guard.margin"),
        ("max_norm = 0.0", "guard.max_norm"),
        ("max_norm = nan", "guard.max_norm"),
        ("max_norm = -1.0", "guard.max_norm"),
        ("floor = -1.0", "guard.floor"),
        ("floor = inf", "guard.floor"),
    ] {
        let e = Config::parse(&format!("{MINIMAL}[guard]\n{line}\n"), Path::new("/")).unwrap_err();
        assert!(
            matches!(&e, ConfigError::Invalid { key: k, .. } if *k == key),
            "{line}: {e}"
        );
    }
}

#[test]
fn topk2_keys_are_range_checked() {
    let ok = Config::parse(
        &format!("{MINIMAL}[compression]\nscheme = \"topk2\"\npull_scheme = \"topk2\"\nbucket = 4096\nkeep = 32\n"),
        Path::new("/"),
    )
    .unwrap();
    assert_eq!(
        (
            ok.compression.codec().keep,
            ok.compression.pull_codec().keep
        ),
        (32, 32)
    );
    assert_eq!(ok.compression.codec().scheme, Scheme::Topk2);
    for (extra, key) in [
        ("keep = 3", "compression.keep"),
        ("keep = 1", "compression.keep"),
        ("keep = 65536", "compression.keep"),
        ("scheme = \"topk2\"\nbucket = 131072", "compression.bucket"),
        (
            "pull_scheme = \"topk2\"\nbucket = 131072",
            "compression.bucket",
        ),
        // The codec needs a multiple of 16: refused here, not when a node starts.
        ("bucket = 20", "compression.bucket"),
        ("bucket = 8", "compression.bucket"),
        ("bucket = 2097152", "compression.bucket"),
    ] {
        let e = Config::parse(
            &format!("{MINIMAL}[compression]\n{extra}\n"),
            Path::new("/"),
        )
        .unwrap_err();
        assert!(
            matches!(&e, ConfigError::Invalid { key: k, .. } if *k == key),
            "{extra}: {e}"
        );
    }
    // A large bucket is fine for the dense schemes.
    Config::parse(
        &format!("{MINIMAL}[compression]\nbucket = 131072\n"),
        Path::new("/"),
    )
    .unwrap();
}

#[test]
fn fragments_are_range_checked_and_need_local_step_rounds() {
    let ok = Config::parse(
        &format!("{MINIMAL}[train]\nlocal_steps = 16\nfragments = 4\n"),
        Path::new("/"),
    )
    .unwrap();
    assert_eq!(ok.train.fragments, 4);
    for extra in [
        "fragments = 0",
        "fragments = 65",
        "fragments = 2",
        "local_steps = 0\nfragments = 4",
    ] {
        let e = Config::parse(&format!("{MINIMAL}[train]\n{extra}\n"), Path::new("/")).unwrap_err();
        assert!(
            matches!(&e, ConfigError::Invalid { key, .. } if *key == "train.fragments"),
            "{extra}: {e}"
        );
    }
}

#[test]
fn a_combination_measured_to_diverge_gets_a_warning() {
    let diverging = "[train]\nlocal_steps = 16\n[optimizer.outer]\nmomentum = 0.9\n";
    let c = Config::parse(
        &format!("{MINIMAL}staleness = 3\n{diverging}"),
        Path::new("/"),
    )
    .unwrap();
    let w = c.warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].contains("optimizer.outer.momentum") && w[0].contains("0.15"),
        "{}",
        w[0]
    );
    // The quickstart's sync (outer lr 1.4) with stale rounds trains badly too.
    let sparse_sync = "[train]\nlocal_steps = 16\n[optimizer.outer]\nlr = 1.4\nmomentum = 0.5\n";
    let c = Config::parse(
        &format!("{MINIMAL}staleness = 3\n{sparse_sync}"),
        Path::new("/"),
    )
    .unwrap();
    let w = c.warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].contains("optimizer.outer.lr") && w[0].contains("0.67"),
        "{}",
        w[0]
    );
    // The defaults, BSP rounds, a push every step, or momentum 0.5 and lr <= 1: no warning.
    for text in [
        format!("{MINIMAL}staleness = 0\n{sparse_sync}"),
        MINIMAL.to_string(),
        format!("{MINIMAL}staleness = 0\n{diverging}"),
        format!("{MINIMAL}staleness = 3\n[optimizer.outer]\nmomentum = 0.9\n"),
        format!("{MINIMAL}staleness = 3\n[train]\nlocal_steps = 16\n"),
    ] {
        let c = Config::parse(&text, Path::new("/")).unwrap();
        assert!(c.warnings().is_empty(), "{text}: {:?}", c.warnings());
    }
}

#[test]
fn a_quorum_beyond_the_workers_or_a_bad_grace_factor_is_refused_naming_the_key() {
    let parse = |extra: &str| {
        Config::parse(
            &format!("[cluster]\nservers=[\"a:1\"]\nworkers = 4\n{extra}\n"),
            Path::new("/"),
        )
    };
    let e = parse("quorum = 5").unwrap_err();
    assert!(e.to_string().contains("cluster.quorum"), "{e}");
    for g in ["0.0", "-1.0", "101.0", "nan"] {
        let e = parse(&format!("quorum = 3\ngrace_factor = {g}")).unwrap_err();
        assert!(e.to_string().contains("cluster.grace_factor"), "{g}: {e}");
    }
    let ok = parse("quorum = 4\ngrace_factor = 2.0").unwrap();
    assert_eq!((ok.cluster.quorum, ok.cluster.grace_factor), (4, 2.0));
    assert_eq!(parse("").unwrap().cluster.quorum, 0);
}

#[test]
fn max_workers_below_the_workers_or_beyond_4096_is_refused_naming_the_key() {
    let parse = |extra: &str| {
        Config::parse(
            &format!("[cluster]\nservers=[\"a:1\"]\nworkers = 4\n{extra}\n"),
            Path::new("/"),
        )
    };
    for bad in ["max_workers = 3", "max_workers = 4097"] {
        let e = parse(bad).unwrap_err();
        assert!(e.to_string().contains("cluster.max_workers"), "{bad}: {e}");
    }
    assert_eq!(parse("").unwrap().cluster.rank_limit(), 4);
    assert_eq!(parse("max_workers = 4").unwrap().cluster.rank_limit(), 4);
    assert_eq!(parse("max_workers = 6").unwrap().cluster.rank_limit(), 6);
}

#[test]
fn standbys_that_name_a_server_or_each_other_or_miss_a_shard_are_refused_naming_the_key() {
    let parse = |extra: &str| {
        Config::parse(
            &format!(
                "[cluster]\nservers=[\"a:1\", \"b:1\"]\nworkers = 2\nwitness = \"w:1\"\n{extra}\n"
            ),
            Path::new("/"),
        )
    };
    // Standbys without the fence's third vote are refused.
    let unfenced = Config::parse(
        "[cluster]\nservers=[\"a:1\", \"b:1\"]\nworkers = 2\nstandbys = [\"c:1\", \"d:1\"]\n",
        Path::new("/"),
    )
    .unwrap_err()
    .to_string();
    assert!(unfenced.contains("cluster.witness"), "{unfenced}");
    for (extra, why) in [
        ("standbys = [\"c:1\"]", "one per shard"),
        ("standbys = [\"b:1\", \"c:1\"]", "address of server 1"),
        ("standbys = [\"a:1\", \"c:1\"]", "address of server 0"),
        ("standbys = [\"c:1\", \"c:1\"]", "listed twice"),
        (
            "standbys = [\"c:1\", \"d:1\"]\nfailover_ms = 100",
            "failover_ms",
        ),
        (
            "standbys = [\"c:1\", \"d:1\"]\nfailover_ms = 6000",
            "failover_ms",
        ),
    ] {
        let e = parse(extra).unwrap_err().to_string();
        assert!(e.contains("cluster."), "{extra}: {e}");
        assert!(e.contains(why), "{extra}: {e}");
    }
    let ok = parse("standbys = [\"c:1\", \"d:1\"]\nfailover_ms = 500").unwrap();
    assert!(ok.cluster.replicated());
    assert_eq!(ok.cluster.shard_addresses(1), vec!["b:1", "d:1"]);
    let plain = parse("").unwrap();
    assert!(!plain.cluster.replicated());
    assert_eq!(plain.cluster.failover_ms, 1000);
    assert_eq!(plain.cluster.shard_addresses(0), vec!["a:1"]);
}

#[test]
fn shard_threads_are_a_count_up_to_1024_naming_the_key() {
    let cfg = Config::parse(&format!("{MINIMAL}[shard]\nthreads = 3\n"), Path::new("/")).unwrap();
    assert_eq!(cfg.shard.threads, 3);
    let e = Config::parse(
        &format!("{MINIMAL}[shard]\nthreads = 1025\n"),
        Path::new("/"),
    )
    .unwrap_err();
    assert!(e.to_string().contains("shard.threads"), "{e}");
}
