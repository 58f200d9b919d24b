//! Checkpoints in a real S3-compatible object store: moto's server mode (`moto_server`, PyPI), started here on
//! 127.0.0.1 for each test. Cases: resume from the store after the shard's disk is wiped; an upload cut short (data
//! objects without their manifest, which is what a kill -9 mid-upload leaves, since the manifest is the last PUT)
//! leaves the previous checkpoint usable and is pruned later; a corrupted object is detected and skipped; a forged
//! checkpoint (whoever can write to the bucket, without the shard's key) is skipped and never replaces a good local
//! one; keep-K
//! applied remotely; and a shard that checkpoints to the store in the background (no local copies), shut down, and
//! resumed from the store on a fresh disk.
//!
//! Without `moto_server` on PATH the tests say so and pass, unless `TETHER_REQUIRE_S3=1` (set by `.ci/run`, which
//! installs it), which turns a missing server into a failure.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, PutPayload};
use tether_common::config::{Config, Staleness};
use tether_common::layout::model_layout;
use tether_common::pki::CheckpointKey;
use tether_server::checkpoint::{CheckpointStore, ShardSnapshot, MANIFEST_FILE, WEIGHTS_FILE};
use tether_server::remote::RemoteStore;

const BUCKET: &str = "tether";

/// A moto server on a free loopback port, killed on drop.
struct Moto {
    child: Child,
    endpoint: String,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn http(addr: &str, request: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(request.as_bytes())?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    Ok(out)
}

/// Starts moto with one bucket; `None` (and a note) when moto_server is not installed and not required.
fn moto() -> Option<Moto> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = match Command::new("moto_server")
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            assert!(
                std::env::var("TETHER_REQUIRE_S3").is_err(),
                "moto_server is required (TETHER_REQUIRE_S3) but cannot start: {e}"
            );
            eprintln!("SKIPPED: moto_server not found ({e}); pip install 'moto[server]' to run the S3 tests");
            return None;
        }
    };
    let addr = format!("127.0.0.1:{port}");
    let moto = Moto {
        child,
        endpoint: format!("http://{addr}"),
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let put = format!("PUT /{BUCKET} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        if let Ok(r) = http(&addr, &put) {
            if r.starts_with("HTTP/1.1 200") {
                return Some(moto);
            }
        }
        assert!(
            Instant::now() < deadline,
            "moto_server did not come up on {addr}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn s3(m: &Moto) -> Arc<dyn ObjectStore> {
    Arc::new(
        AmazonS3Builder::new()
            .with_endpoint(&m.endpoint)
            .with_allow_http(true)
            .with_bucket_name(BUCKET)
            .with_region("us-east-1")
            .with_access_key_id("test")
            .with_secret_access_key("test")
            .build()
            .unwrap(),
    )
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The shard's checkpoint key in these tests.
fn key() -> CheckpointKey {
    CheckpointKey::from_bytes([3; 32])
}

const RANGE: (u64, u64) = (100, 1100);
const LAYOUT: u64 = 0xfeed;

fn snapshot(version: u64) -> ShardSnapshot {
    let n = (RANGE.1 - RANGE.0) as usize;
    ShardSnapshot {
        layout_hash: LAYOUT,
        shard: 1,
        range: RANGE,
        version,
        opt_steps: version,
        clocks: vec![(0, version), (1, version + 1)],
        evicted: vec![(2, version)],
        weights: (0..n)
            .map(|i| (i as f32 * 0.01 + version as f32).sin())
            .collect(),
        slots: vec![(0..n).map(|i| i as f32 * version as f32).collect()],
        pending: Vec::new(),
    }
}

fn same(a: &ShardSnapshot, b: &ShardSnapshot) -> bool {
    a.version == b.version
        && a.weights
            .iter()
            .zip(&b.weights)
            .all(|(x, y)| x.to_bits() == y.to_bits())
        && a.slots == b.slots
        && a.clocks == b.clocks
}

/// Writes `version` locally and uploads it.
fn write_and_upload(
    rt: &tokio::runtime::Runtime,
    local: &CheckpointStore,
    remote: &RemoteStore,
    version: u64,
) {
    let dir = local.write(&snapshot(version)).unwrap();
    rt.block_on(remote.upload(&dir, version)).unwrap();
}

fn wipe(dir: &Path) {
    std::fs::remove_dir_all(dir).unwrap();
    assert!(!dir.exists());
}

#[test]
fn resume_from_the_store_after_the_local_disk_is_wiped() {
    let Some(m) = moto() else { return };
    let rt = rt();
    let tmp = tempfile::tempdir().unwrap();
    let local = CheckpointStore::new(tmp.path().join("shard-1"), 3, key());
    let remote = RemoteStore::new(s3(&m), "runs/a", 1, 3);
    write_and_upload(&rt, &local, &remote, 10);
    write_and_upload(&rt, &local, &remote, 20);
    assert_eq!(rt.block_on(remote.versions()).unwrap(), vec![20, 10]);
    wipe(local.dir());
    let (v, skipped) = rt
        .block_on(remote.restore_into(&local, LAYOUT, 1, RANGE))
        .unwrap()
        .unwrap();
    assert_eq!((v, skipped.len()), (20, 0));
    let (snap, _) = local.load_latest(LAYOUT, 1, RANGE).unwrap().unwrap();
    assert!(same(&snap, &snapshot(20)), "restored another snapshot");
}

#[test]
fn an_upload_cut_short_leaves_the_previous_checkpoint_usable() {
    let Some(m) = moto() else { return };
    let rt = rt();
    let tmp = tempfile::tempdir().unwrap();
    let local = CheckpointStore::new(tmp.path().join("shard-1"), 3, key());
    let store = s3(&m);
    let remote = RemoteStore::new(store.clone(), "", 1, 1);
    write_and_upload(&rt, &local, &remote, 5);
    // Version 6 dies mid-upload: its data objects are in the store, its manifest (always the last PUT) is not.
    let dir6 = local.write(&snapshot(6)).unwrap();
    let bytes = std::fs::read(dir6.join(WEIGHTS_FILE)).unwrap();
    let part = ObjPath::from(format!("shard-1/v{:020}/{WEIGHTS_FILE}", 6));
    rt.block_on(store.put(&part, PutPayload::from(bytes)))
        .unwrap();
    assert_eq!(
        rt.block_on(remote.versions()).unwrap(),
        vec![5],
        "a version without a manifest is listed"
    );
    wipe(local.dir());
    let (v, _) = rt
        .block_on(remote.restore_into(&local, LAYOUT, 1, RANGE))
        .unwrap()
        .unwrap();
    assert_eq!(v, 5);
    let (snap, _) = local.load_latest(LAYOUT, 1, RANGE).unwrap().unwrap();
    assert!(same(&snap, &snapshot(5)));
    // The next complete upload (keep 1) prunes both the old version and the stale partial one below it.
    write_and_upload(&rt, &local, &remote, 7);
    let left: Vec<String> = rt
        .block_on(async {
            use futures::TryStreamExt;
            store.list(None).try_collect::<Vec<_>>().await
        })
        .unwrap()
        .into_iter()
        .map(|o| o.location.to_string())
        .collect();
    assert!(
        left.iter().all(|p| p.contains(&format!("v{:020}", 7))),
        "{left:?}"
    );
}

#[test]
fn a_corrupted_object_is_detected_and_skipped() {
    let Some(m) = moto() else { return };
    let rt = rt();
    let tmp = tempfile::tempdir().unwrap();
    let local = CheckpointStore::new(tmp.path().join("shard-1"), 3, key());
    let store = s3(&m);
    let remote = RemoteStore::new(store.clone(), "p", 1, 3);
    write_and_upload(&rt, &local, &remote, 1);
    write_and_upload(&rt, &local, &remote, 2);
    // Flip one byte of the newest checkpoint's weights object.
    let obj = ObjPath::from(format!("p/shard-1/v{:020}/{WEIGHTS_FILE}", 2));
    let mut bytes = rt
        .block_on(async { store.get(&obj).await?.bytes().await })
        .unwrap()
        .to_vec();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    rt.block_on(store.put(&obj, PutPayload::from(bytes)))
        .unwrap();
    wipe(local.dir());
    let (v, skipped) = rt
        .block_on(remote.restore_into(&local, LAYOUT, 1, RANGE))
        .unwrap()
        .unwrap();
    assert_eq!(v, 1, "the corrupted newest checkpoint was used");
    assert_eq!(skipped.len(), 1);
    assert_eq!(skipped[0].0, 2);
    assert!(
        skipped[0].1.contains("checksum")
            || skipped[0].1.contains("zstd")
            || skipped[0].1.contains("format"),
        "{}",
        skipped[0].1
    );
    // The bad download was removed; only version 1 is on disk.
    let listed: Vec<u64> = local.list().unwrap().into_iter().map(|(v, _)| v).collect();
    assert_eq!(listed, vec![1]);
    // A corrupted manifest is skipped the same way.
    let man = ObjPath::from(format!("p/shard-1/v{:020}/{MANIFEST_FILE}", 1));
    rt.block_on(store.put(&man, PutPayload::from(b"{\"body\": 1}".to_vec())))
        .unwrap();
    wipe(local.dir());
    let err = rt
        .block_on(remote.restore_into(&local, LAYOUT, 1, RANGE))
        .unwrap_err();
    assert!(err.to_string().contains("none of 2"), "{err}");
}

#[test]
fn a_forged_remote_checkpoint_is_skipped_and_never_replaces_a_local_one() {
    use ring::{digest, hmac};
    let Some(m) = moto() else { return };
    let rt = rt();
    let tmp = tempfile::tempdir().unwrap();
    let local = CheckpointStore::new(tmp.path().join("shard-1"), 3, key());
    let store = s3(&m);
    let remote = RemoteStore::new(store.clone(), "f", 1, 3);
    write_and_upload(&rt, &local, &remote, 1);
    write_and_upload(&rt, &local, &remote, 2);
    // Whoever can write to the bucket replaces version 2's weights (finite, plausible values) and fixes up the
    // manifest: size, SHA-256, and a MAC under a key that is not the shard's.
    let n = (RANGE.1 - RANGE.0) as usize;
    let raw: Vec<u8> = vec![0.25f32; n]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let forged = zstd::bulk::compress(&raw, 1).unwrap();
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let weights = ObjPath::from(format!("f/shard-1/v{:020}/{WEIGHTS_FILE}", 2));
    let man = ObjPath::from(format!("f/shard-1/v{:020}/{MANIFEST_FILE}", 2));
    let mut envelope: serde_json::Value = serde_json::from_slice(
        &rt.block_on(async { store.get(&man).await?.bytes().await })
            .unwrap(),
    )
    .unwrap();
    envelope["body"]["files"][0]["bytes"] = (forged.len() as u64).into();
    envelope["body"]["files"][0]["digest"] =
        hex(digest::digest(&digest::SHA256, &forged).as_ref()).into();
    let mut msg = tether_server::checkpoint::MAC_CONTEXT.to_vec();
    msg.extend(serde_json::to_vec(&envelope["body"]).unwrap());
    let tag = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, &[4; 32]), &msg);
    envelope["hmac_sha256"] = hex(tag.as_ref()).into();
    rt.block_on(async {
        store.put(&weights, PutPayload::from(forged)).await?;
        store
            .put(
                &man,
                PutPayload::from(serde_json::to_vec(&envelope).unwrap()),
            )
            .await
    })
    .unwrap();

    // With the local copies still there, restoring must not replace the good local version 2 with the forgery.
    let (v, skipped) = rt
        .block_on(remote.restore_into(&local, LAYOUT, 1, RANGE))
        .unwrap()
        .unwrap();
    assert_eq!(v, 1, "the forged newest checkpoint was used");
    assert_eq!(skipped.len(), 1);
    assert_eq!(skipped[0].0, 2);
    assert!(skipped[0].1.contains("MAC"), "{}", skipped[0].1);
    let (snap, skipped) = local.load_latest(LAYOUT, 1, RANGE).unwrap().unwrap();
    assert!(skipped.is_empty());
    assert!(
        same(&snap, &snapshot(2)),
        "the local version 2 was replaced"
    );

    // On a wiped disk, the forgery is skipped and the authentic version 1 restored.
    wipe(local.dir());
    let (v, _) = rt
        .block_on(remote.restore_into(&local, LAYOUT, 1, RANGE))
        .unwrap()
        .unwrap();
    assert_eq!(v, 1);
    let (snap, _) = local.load_latest(LAYOUT, 1, RANGE).unwrap().unwrap();
    assert!(same(&snap, &snapshot(1)));
    let listed: Vec<u64> = local.list().unwrap().into_iter().map(|(v, _)| v).collect();
    assert_eq!(listed, vec![1], "the forged download was left on disk");
}

#[test]
fn keep_k_applies_to_the_store() {
    let Some(m) = moto() else { return };
    let rt = rt();
    let tmp = tempfile::tempdir().unwrap();
    let local = CheckpointStore::new(tmp.path().join("shard-1"), 5, key());
    let remote = RemoteStore::new(s3(&m), "k", 1, 2);
    for v in 1..=5 {
        write_and_upload(&rt, &local, &remote, v);
    }
    assert_eq!(rt.block_on(remote.versions()).unwrap(), vec![5, 4]);
}

#[test]
fn a_shard_checkpoints_to_the_store_in_the_background_and_resumes_from_it() {
    let Some(m) = moto() else { return };
    use tether_common::codec::{CodecConfig, Encoder};
    use tether_common::protocol::{encode_push, Outcome, PushFrame};
    use tether_server::actor::{ApplyPush, Hello};
    use tether_server::node::{start_shard, ShardOptions};

    let tmp = tempfile::tempdir().unwrap();
    tether_common::pki::generate_dev(&tmp.path().join("certs"), &[], 1, 1).unwrap();
    let mut cfg = Config::with_servers(vec!["127.0.0.1:0".into()]);
    cfg.model.features = Some(32);
    cfg.model.hidden = vec![16];
    cfg.model.classes = Some(4);
    cfg.cluster.workers = 1;
    cfg.cluster.staleness = Staleness::Bounded(1);
    cfg.cluster.tls_dir = tmp.path().join("certs");
    cfg.checkpoint.dir = tmp.path().join("ckpt");
    cfg.checkpoint.every_updates = 5;
    cfg.checkpoint.keep = 2;
    cfg.checkpoint.url = Some(format!("s3://{BUCKET}/shard-test"));
    cfg.checkpoint.local = false;
    for (k, v) in [
        ("AWS_ENDPOINT", m.endpoint.as_str()),
        ("AWS_ALLOW_HTTP", "true"),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
    ] {
        std::env::set_var(k, v);
    }
    let params = model_layout(&cfg).unwrap().len();
    let sys = actix_rt::System::with_tokio_rt(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    });
    let (first, second) = sys.block_on(async move {
        let shard = start_shard(
            &cfg,
            ShardOptions {
                shard: 0,
                ..ShardOptions::default()
            },
        )
        .await
        .unwrap();
        let (kick, _k) = tokio::sync::oneshot::channel();
        let mut clock = shard
            .actor
            .send(Hello {
                conn: 1,
                worker: 0,
                clock: 0,
                kick,
            })
            .await
            .unwrap()
            .unwrap()
            .clock;
        let mut payload = Vec::new();
        Encoder::new(CodecConfig::default())
            .unwrap()
            .encode(&vec![1e-3; params], 1, &mut payload)
            .unwrap();
        for _ in 0..12 {
            let body = encode_push(&PushFrame {
                worker: 0,
                clock,
                shard: 0,
                range_start: 0,
                range_end: params as u64,
                read_version: 0,
                loss: 1.0,
                skip: false,
                payload: payload.clone(),
            })
            .unwrap();
            let o = shard
                .actor
                .send(ApplyPush { conn: 1, body })
                .await
                .unwrap()
                .unwrap()
                .outcome;
            assert_eq!(o, Outcome::Applied);
            clock += 1;
        }
        // The final checkpoint (version 12) is uploaded before shutdown returns; the earlier ones in the background.
        let (_, stats) = shard.shutdown(true).await.unwrap();
        assert_eq!(stats.updates_applied, 12);
        let remote = RemoteStore::from_url(cfg.checkpoint.url.as_deref().unwrap(), 0, 2).unwrap();
        let remote_versions = remote.versions().await.unwrap();
        // No local copies were kept.
        let local: Vec<_> = std::fs::read_dir(cfg.checkpoint.dir.join("shard-0"))
            .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name()).collect())
            .unwrap_or_default();
        let resumed = start_shard(
            &cfg,
            ShardOptions {
                shard: 0,
                resume: true,
                ..ShardOptions::default()
            },
        )
        .await
        .unwrap();
        let from = resumed.resumed_from;
        resumed.kill();
        ((remote_versions, local), from)
    });
    let ((remote_versions, local), resumed_from) = (first, second);
    assert_eq!(remote_versions.first(), Some(&12), "{remote_versions:?}");
    assert!(remote_versions.len() <= 2, "keep 2: {remote_versions:?}");
    assert!(
        local.iter().all(|n| !n.to_string_lossy().starts_with('v')),
        "local copies kept: {local:?}"
    );
    assert_eq!(resumed_from, Some(12));
}
