//! Feeds arbitrary and damaged `cluster.toml` texts to the parser and validator: any panic is a finding. Half the
//! inputs are raw text; the other half are a complete configuration (every section of docs/design.md's example, with
//! extensions) with one value replaced by text from the input, so that every key's validation is reached. A
//! configuration that parses must also answer its derived questions (layout, codec, model dimensions).
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use tether_common::config::Config;
use tether_common::layout;

/// `(key line prefix, original value)` of the template; the input replaces one value.
const TEMPLATE: &[(&str, &str)] = &[
    (
        "[cluster]\nservers = ",
        "[\"127.0.0.1:7000\", \"127.0.0.1:7001\"]",
    ),
    ("workers = ", "4"),
    ("staleness = ", "3"),
    ("worker_timeout_ms = ", "5000"),
    ("heartbeat_ms = ", "500"),
    ("tls_dir = ", "\"certs\""),
    ("[model]\nkind = ", "\"mlp\""),
    ("hidden = ", "[256, 128]"),
    ("seed = ", "42"),
    ("[data]\ndataset = ", "\"fashion-mnist\""),
    ("path = ", "\"/usr/share/datasets/fashion-mnist\""),
    ("[train]\nbatch = ", "128"),
    ("epochs = ", "5"),
    ("eval_every = ", "200"),
    ("clip_norm = ", "1.0"),
    ("[optimizer]\nkind = ", "\"adam\""),
    ("lr = ", "1e-3"),
    (
        "schedule = ",
        "{ kind = \"warmup_cosine\", warmup = 100, total = 20000, min_ratio = 0.01 }",
    ),
    ("[compression]\nscheme = ", "\"q4\""),
    ("bucket = ", "512"),
    ("error_feedback = ", "true"),
    ("zstd = ", "true"),
    ("[checkpoint]\ndir = ", "\"ckpt\""),
    ("every_updates = ", "500"),
    ("keep = ", "3"),
];

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let input = String::from_utf8_lossy(rest);
    let text = if mode & 1 == 0 {
        input.into_owned()
    } else {
        let pick = usize::from(mode >> 1) % TEMPLATE.len();
        TEMPLATE
            .iter()
            .enumerate()
            .map(|(i, (key, value))| {
                let v = if i == pick { input.as_ref() } else { value };
                format!("{key}{v}\n")
            })
            .collect()
    };
    if let Ok(cfg) = Config::parse(&text, Path::new("/etc/tether")) {
        let _ = cfg.validate();
        let _ = layout::model_io(&cfg);
        let _ = layout::model_dims(&cfg);
        let _ = layout::model_layout(&cfg);
        let _ = cfg.compression.codec().validate();
    }
});
