//! Feeds arbitrary text to the `cluster.toml` parser and validator: any panic is a finding. A configuration that
//! parses must also answer its derived questions (layout, codec, model dimensions) without panicking.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use tether_common::config::Config;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(cfg) = Config::parse(&text, Path::new("/etc/tether")) {
        let _ = cfg.validate();
        let _ = cfg.model_io();
        let _ = cfg.model_dims();
        let _ = cfg.layout();
        let _ = cfg.compression.codec().validate();
    }
});
