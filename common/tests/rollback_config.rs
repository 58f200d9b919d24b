//! The `[rollback]` section of cluster.toml: off by default with documented defaults, unknown keys named, values
//! validated (including that `keep` snapshots reach back before a spike under the staleness bound).

use std::path::Path;

use tether_common::config::{Config, ConfigError, RollbackConfig, Staleness};

fn parse(extra: &str) -> Result<Config, ConfigError> {
    Config::parse(
        &format!("[cluster]\nservers = [\"127.0.0.1:7000\"]\n{extra}"),
        Path::new("/tmp"),
    )
}

#[test]
fn rollback_is_off_by_default_and_its_keys_parse() {
    let cfg = parse("").unwrap();
    assert_eq!(cfg.rollback, RollbackConfig::default());
    assert!(!cfg.rollback.enabled);
    let cfg = parse(
        "[rollback]\nenabled = true\nfactor = 4.0\nrounds = 3\nwindow = 8\nevery = 5\nkeep = 4\n\
         lr_scale = 0.3\nlr_rounds = 20\n",
    )
    .unwrap();
    let r = cfg.rollback;
    assert!(r.enabled);
    assert_eq!(
        (r.factor, r.rounds, r.window, r.every, r.keep),
        (4.0, 3, 8, 5, 4)
    );
    assert_eq!((r.lr_scale, r.lr_rounds), (0.3, 20));
}

#[test]
fn unknown_keys_and_bad_values_are_errors_naming_the_key() {
    let e = parse("[rollback]\nenable = true\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("enable"), "{e}");
    for (text, key) in [
        ("factor = 1.0", "rollback.factor"),
        ("factor = nan", "rollback.factor"),
        ("rounds = 0", "rollback.rounds"),
        ("every = 0", "rollback.rounds/window/every"),
        ("lr_scale = 0.0", "rollback.lr_scale"),
        ("lr_scale = 2.0", "rollback.lr_scale"),
    ] {
        let e = parse(&format!("[rollback]\n{text}\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(key.split('/').next().unwrap()), "{text}: {e}");
    }
}

#[test]
fn keep_must_reach_before_a_spike_seen_late() {
    // BSP, m = 2, every 10: the target is at most 2 boundaries back.
    let bsp = "[rollback]\nenabled = true\nkeep = 2\n";
    let cfg = Config::parse(
        &format!("[cluster]\nservers = [\"a:1\"]\nstaleness = 0\n{bsp}"),
        Path::new("/tmp"),
    );
    assert!(cfg.is_ok(), "{cfg:?}");
    // s = 6: a spike may show 12 rounds late, so 3 snapshots 10 rounds apart are needed.
    let late = "[rollback]\nenabled = true\nkeep = 2\n";
    let e = Config::parse(
        &format!("[cluster]\nservers = [\"a:1\"]\nstaleness = 6\n{late}"),
        Path::new("/tmp"),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("rollback.keep"), "{e}");
    assert_eq!(RollbackConfig::margin(Staleness::Bounded(6)), 12);
    assert_eq!(RollbackConfig::margin(Staleness::Unbounded), 0);
    // Disabled, the same keep is fine.
    assert!(Config::parse(
        "[cluster]\nservers = [\"a:1\"]\nstaleness = 6\n[rollback]\nkeep = 2\n",
        Path::new("/tmp")
    )
    .is_ok());
}
