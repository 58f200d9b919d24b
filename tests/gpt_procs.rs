//! The GPT across real processes, as a cluster runs it: two `tether-server` shards build the GPT's layout from
//! `cluster.toml` alone (no candle on the shards), two `tether-worker`s train it through candle on the embedded KJV
//! excerpt in local-step rounds, and worker 0's JSON report carries the validation loss, below the bound, with bits
//! per character.

mod support;

use std::time::Duration;

use support::{num, Cluster, Spec};

#[test]
fn binaries_train_the_gpt_from_cluster_toml() {
    let c = Cluster::new(Spec {
        shards: 2,
        workers: 2,
        ..Spec::default()
    });
    let servers: Vec<String> = c.servers.iter().map(|a| format!("\"{a}\"")).collect();
    let config = format!(
        "[cluster]\nservers = [{}]\nworkers = 2\nstaleness = 0\nworker_timeout_ms = 5000\n\
         [model]\nkind = \"gpt\"\nlayers = 1\nheads = 2\ndim = 32\ncontext = 16\nseed = 42\n\
         [data]\ndataset = \"kjv-excerpt\"\n\
         [train]\nepochs = 1\nmax_steps = 400\nbatch = 32\neval_every = 0\nlocal_steps = 8\n\
         [optimizer]\nkind = \"adam\"\nlr = 0.003\n\
         schedule = {{ kind = \"warmup_cosine\", warmup = 30, total = 400, min_ratio = 0.1 }}\n\
         [optimizer.outer]\nmomentum = 0.5\n\
         [checkpoint]\nevery_updates = 0\n",
        servers.join(", ")
    );
    std::fs::write(c.path("cluster.toml"), config).unwrap();
    let mut shards: Vec<_> = (0..2)
        .map(|k| c.server(k, &["--exit-after-workers", "2"]))
        .collect();
    let mut workers: Vec<_> = (0..2)
        .map(|r| c.worker(r, &["--report", &format!("w{r}.json")]))
        .collect();
    for w in &mut workers {
        w.wait_success(Duration::from_secs(120));
    }
    for s in &mut shards {
        s.wait_success(Duration::from_secs(30));
    }
    let r = c.report("w0.json");
    let val = num(&r, "final_val_loss");
    let bpc = num(&r, "final_bits_per_char");
    println!("binaries: GPT validation loss {val:.4} ({bpc:.3} bits per character)");
    assert!((bpc - val / std::f64::consts::LN_2).abs() < 1e-6);
    // Measured 2.13; a unigram model of the text scores 3.0 and the initial model ln 256 = 5.55.
    assert!(val < 2.4, "validation loss {val}");
    assert_eq!(num(&r, "steps"), 400.0);
}
