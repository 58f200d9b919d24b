//! Feeds damaged checkpoints to the shard's loader (`CheckpointStore::load_latest`, which reads the manifest, checks
//! its MAC, every data file's SHA-256 and size, decompresses, and checks the values). A valid checkpoint of a small
//! shard is written once as the template; each input then either replaces the manifest, overwrites bytes of the
//! manifest or of a data file, replaces or truncates a data file, removes one, or replaces the manifest body with
//! the input's JSON *signed with the store's key* (so the checks behind the MAC are fuzzed too: what a key holder's
//! bug could write). Any panic is a finding; a damaged checkpoint must come back as a typed error (or, where the
//! damage is harmless, as the snapshot it still is), and whatever loads has passed the value checks.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use ring::hmac;
use tether_common::pki::CheckpointKey;
use tether_server::checkpoint::{
    CheckpointStore, ShardSnapshot, MAC_CONTEXT, MANIFEST_FILE, WEIGHTS_FILE,
};
use tether_server::shard::MAX_CLOCK;

const N: usize = 300;
const LAYOUT_HASH: u64 = 0x7e7e;
const KEY: [u8; 32] = [0x5a; 32];

/// A manifest whose body is `body` (JSON text), with a valid MAC under [`KEY`]; `None` if `body` is not JSON.
fn signed_manifest(body: &[u8]) -> Option<Vec<u8>> {
    let body: serde_json::Value = serde_json::from_slice(body).ok()?;
    let mut msg = MAC_CONTEXT.to_vec();
    msg.extend(serde_json::to_vec(&body).ok()?);
    let tag = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, &KEY), &msg);
    let hex: String = tag.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    serde_json::to_vec(&serde_json::json!({ "body": body, "hmac_sha256": hex })).ok()
}

struct Template {
    root: PathBuf,
    version_dir: PathBuf,
    files: Vec<(String, Vec<u8>)>,
}

fn template() -> &'static Template {
    static T: OnceLock<Template> = OnceLock::new();
    T.get_or_init(|| {
        // A memory file system when there is one: every input rewrites the checkpoint's files.
        let shm = PathBuf::from("/dev/shm");
        let base = std::env::var_os("TETHER_FUZZ_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                if shm.is_dir() {
                    shm
                } else {
                    std::env::temp_dir()
                }
            });
        let root = base.join(format!("tether-fuzz-ckpt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let store = CheckpointStore::new(root.clone(), 1, CheckpointKey::from_bytes(KEY));
        let wave = |k: f32| (0..N).map(|i| (i as f32 * k).sin()).collect::<Vec<f32>>();
        let snap = ShardSnapshot {
            layout_hash: LAYOUT_HASH,
            shard: 0,
            range: (0, N as u64),
            version: 7,
            opt_steps: 7,
            clocks: vec![(0, 3), (1, 4)],
            evicted: vec![(2, 2)],
            weights: wave(0.1),
            slots: vec![wave(0.2), wave(0.3)],
            // An open round's sum (a shard stepping at round close), so the pend files are fuzzed too.
            pending: vec![(5, wave(0.4))],
        };
        let version_dir = store
            .write(&snap)
            .expect("the template checkpoint is written");
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&version_dir)
            .expect("template directory")
            .map(|e| {
                let e = e.expect("entry");
                let name = e.file_name().to_string_lossy().into_owned();
                (name, std::fs::read(e.path()).expect("template file"))
            })
            .collect();
        files.sort();
        Template {
            root,
            version_dir,
            files,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let t = template();
    let Some((&op, rest)) = data.split_first() else {
        return;
    };
    let Some((&which, edit)) = rest.split_first() else {
        return;
    };
    let mut files = t.files.clone();
    let manifest = files
        .iter()
        .position(|(n, _)| n == MANIFEST_FILE)
        .expect("template has a manifest");
    let k = usize::from(which) % files.len();
    match op % 6 {
        // The manifest replaced by the input.
        0 => files[manifest].1 = edit.to_vec(),
        // Bytes of one file overwritten at positions the input names: [pos u16][byte] pairs.
        1 => {
            for pair in edit.chunks_exact(3) {
                let body = &mut files[k].1;
                if !body.is_empty() {
                    let pos = usize::from(u16::from_le_bytes([pair[0], pair[1]])) % body.len();
                    body[pos] = pair[2];
                }
            }
        }
        // A data file replaced by the input.
        2 => {
            let d = if k == manifest {
                (k + 1) % files.len()
            } else {
                k
            };
            files[d].1 = edit.to_vec();
        }
        // One file truncated to a length the input names.
        3 => {
            let cut = edit
                .first_chunk::<2>()
                .map_or(0, |b| usize::from(u16::from_le_bytes(*b)));
            let body = &mut files[k].1;
            body.truncate(cut % (body.len() + 1));
        }
        // One file removed.
        4 => {
            files.remove(k);
        }
        // The manifest body replaced by the input's JSON, signed with the key.
        _ => match signed_manifest(edit) {
            Some(m) => files[manifest].1 = m,
            None => return,
        },
    }
    for (name, _) in &t.files {
        let path = t.version_dir.join(name);
        match files.iter().find(|(n, _)| n == name) {
            Some((_, body)) => std::fs::write(&path, body).expect("write file"),
            None => {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    let store = CheckpointStore::new(t.root.clone(), 1, CheckpointKey::from_bytes(KEY));
    match store.load_latest(LAYOUT_HASH, 0, (0, N as u64)) {
        Ok(Some((snap, _))) => {
            assert_eq!(snap.weights.len(), N);
            assert!(snap.slots.iter().all(|s| s.len() == N));
            assert!(snap.pending.iter().all(|(_, s)| s.len() == N && s.iter().all(|v| v.is_finite())));
            assert!(snap.pending.windows(2).all(|w| w[0].0 < w[1].0));
            assert!(snap.weights.iter().chain(snap.slots.iter().flatten()).all(|v| v.is_finite()));
            assert!(snap.clocks.iter().chain(&snap.evicted).all(|&(_, c)| c <= MAX_CLOCK));
            assert!(snap.opt_steps <= snap.version);
            assert!(files.iter().any(|(n, _)| n == WEIGHTS_FILE));
        }
        Ok(None) => {}
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
