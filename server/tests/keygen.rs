//! `tether-server keygen` as an operator runs it: shard bundles get a checkpoint key (0600); an existing bundle is
//! never replaced without `--force`, and the refusal and the replacement both name the serial to revoke; a
//! re-issued shard keeps its checkpoint key; `keygen checkpoint-key` adds a key to an old bundle and refuses to
//! replace one. And a shard whose bundle has no key refuses to start, saying how to make one.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

use tether_common::config::Config;
use tether_common::pki::CHECKPOINT_KEY_FILE;

fn keygen(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tether-server"))
        .arg("keygen")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("tether-server runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The serials `issued.txt` records for common name `cn`, oldest first.
fn serials(ca: &Path, cn: &str) -> Vec<String> {
    std::fs::read_to_string(ca.join("issued.txt"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (serial, name) = (f.next()?, f.next()?);
            (name == cn).then(|| serial.to_string())
        })
        .collect()
}

#[test]
fn issue_refuses_to_replace_a_bundle_without_force_and_names_the_serials() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let o = keygen(&["--out", "certs", "--workers", "1"], d);
    assert!(o.status.success(), "{}", text(&o));
    let key_path = d.join("certs/server-0").join(CHECKPOINT_KEY_FILE);
    let mode = std::fs::metadata(&key_path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "checkpoint key mode {mode:o}");
    let key = std::fs::read(&key_path).unwrap();
    assert_eq!(key.len(), 65, "64 hex digits and a newline");
    assert!(!d.join("certs/worker-0").join(CHECKPOINT_KEY_FILE).exists());

    let ca = d.join("certs/ca");
    let cert = d.join("certs/worker-0/worker.pem");
    let before = std::fs::read(&cert).unwrap();
    let old = serials(&ca, "tether-worker-0").pop().unwrap();
    let o = keygen(
        &[
            "issue", "--ca", "certs/ca", "--out", "certs", "--worker", "0",
        ],
        d,
    );
    assert!(!o.status.success(), "replaced without --force");
    assert!(
        text(&o).contains(&old),
        "refusal without the serial: {}",
        text(&o)
    );
    assert!(text(&o).contains("--force"), "{}", text(&o));
    assert_eq!(std::fs::read(&cert).unwrap(), before, "bundle changed");

    let o = keygen(
        &[
            "issue", "--ca", "certs/ca", "--out", "certs", "--worker", "0", "--force",
        ],
        d,
    );
    assert!(o.status.success(), "{}", text(&o));
    let issued = serials(&ca, "tether-worker-0");
    let new = issued.last().unwrap();
    assert_ne!(new, &old);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains(new.as_str()), "new serial not printed: {out}");
    assert!(
        out.contains(&format!("revoked = [\"{old}\"]")),
        "old serial not printed for cluster.revoked: {out}"
    );
    assert_ne!(std::fs::read(&cert).unwrap(), before);

    // A shard re-issued with --force keeps its checkpoint key.
    let o = keygen(
        &[
            "issue", "--ca", "certs/ca", "--out", "certs", "--server", "0", "--host", "h0",
            "--force",
        ],
        d,
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        std::fs::read(&key_path).unwrap(),
        key,
        "checkpoint key replaced"
    );

    // A fresh `keygen` into a folder of bundles refuses, even with another CA folder.
    let o = keygen(&["--out", "certs", "--ca-dir", "ca2", "--workers", "1"], d);
    assert!(!o.status.success(), "bundles overwritten");
    assert!(!d.join("ca2/ca.key").exists());

    // checkpoint-key: refuses to replace, writes one where there is none.
    let o = keygen(&["checkpoint-key", "--bundle", "certs/server-0"], d);
    assert!(!o.status.success());
    assert_eq!(std::fs::read(&key_path).unwrap(), key);
    std::fs::remove_file(&key_path).unwrap();
    let o = keygen(&["checkpoint-key", "--bundle", "certs/server-0"], d);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(std::fs::read(&key_path).unwrap().len(), 65);
    assert_ne!(std::fs::read(&key_path).unwrap(), key);
}

#[test]
fn a_shard_without_a_checkpoint_key_refuses_to_start_and_says_how_to_make_one() {
    use tether_server::node::{start_shard, ShardOptions};
    let tmp = tempfile::tempdir().unwrap();
    tether_common::pki::generate_dev(&tmp.path().join("certs"), &[], 1, 1).unwrap();
    std::fs::remove_file(tmp.path().join("certs/server-0").join(CHECKPOINT_KEY_FILE)).unwrap();
    let mut cfg = Config::with_servers(vec!["127.0.0.1:0".into()]);
    cfg.model.features = Some(8);
    cfg.model.hidden = vec![4];
    cfg.model.classes = Some(2);
    cfg.cluster.tls_dir = tmp.path().join("certs");
    cfg.checkpoint.dir = tmp.path().join("ckpt");
    let err = actix_rt::System::new()
        .block_on(start_shard(&cfg, ShardOptions::default()))
        .err()
        .expect("a shard without a checkpoint key started");
    let msg = err.to_string();
    assert!(
        msg.contains(CHECKPOINT_KEY_FILE) && msg.contains("keygen checkpoint-key"),
        "{msg}"
    );
    // checkpoint.key_file names one elsewhere: the shard starts.
    let elsewhere = tmp.path().join("elsewhere.key");
    tether_common::pki::CheckpointKey::generate()
        .unwrap()
        .save(&elsewhere, false)
        .unwrap();
    cfg.checkpoint.key_file = Some(elsewhere);
    let sys = actix_rt::System::with_tokio_rt(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    });
    sys.block_on(async {
        let shard = start_shard(&cfg, ShardOptions::default())
            .await
            .expect("starts with checkpoint.key_file");
        shard.kill();
    });
}
