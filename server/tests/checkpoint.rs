//! The checkpoint store: round trips, pruning, every kind of corruption falling back to the previous checkpoint,
//! forged, foreign-key, unauthenticated (format 1) and out-of-bounds checkpoints skipped the same way, mismatched
//! layouts, stale temporary directories, and bounded allocation on crafted files.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::fs;
use std::path::{Path, PathBuf};

use ring::{digest, hmac};
use serde_json::Value;
use tether_common::pki::CheckpointKey;
use tether_server::checkpoint::{
    CheckpointError, CheckpointStore, ShardSnapshot, MAC_CONTEXT, MANIFEST_FILE, WEIGHTS_FILE,
};
use tether_server::shard::MAX_CLOCK;

/// Records the largest single allocation made by the current thread, so a test can bound what a load allocates.
struct LargestAllocation;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = LARGEST.try_with(|c| c.set(c.get().max(size)));
}

// SAFETY: every call forwards to the system allocator unchanged; only the requested sizes are observed.
unsafe impl GlobalAlloc for LargestAllocation {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: LargestAllocation = LargestAllocation;

const HASH: u64 = 0xdead_beef_f00d_cafe;
const RANGE: (u64, u64) = (1000, 2003);

/// The key of the store under test.
const KEY: [u8; 32] = [7; 32];

/// A snapshot whose values include the awkward finite ones (−0, the extremes, subnormals) and the largest clock.
fn snapshot(version: u64) -> ShardSnapshot {
    let n = (RANGE.1 - RANGE.0) as usize;
    let mut weights: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.013 + version as f32).sin())
        .collect();
    weights[0] = f32::MAX;
    weights[1] = -0.0;
    weights[2] = f32::MIN;
    weights[3] = f32::from_bits(1);
    ShardSnapshot {
        layout_hash: HASH,
        shard: 2,
        range: RANGE,
        version,
        // At most the version (a loaded checkpoint must have it so), and not equal to it.
        opt_steps: version.saturating_sub(1),
        clocks: vec![(0, version), (3, version + 2), (u32::MAX, MAX_CLOCK)],
        evicted: vec![(1, version + 1), (7, 0)],
        weights,
        slots: vec![
            (0..n).map(|i| i as f32 * 1e-3).collect(),
            (0..n).map(|i| (i as f32).sqrt() * version as f32).collect(),
        ],
        pending: Vec::new(),
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn assert_same(a: &ShardSnapshot, b: &ShardSnapshot) {
    assert_eq!(a.layout_hash, b.layout_hash);
    assert_eq!(a.shard, b.shard);
    assert_eq!(a.range, b.range);
    assert_eq!(a.version, b.version);
    assert_eq!(a.opt_steps, b.opt_steps);
    assert_eq!(a.clocks, b.clocks);
    assert_eq!(a.evicted, b.evicted);
    assert_eq!(bits(&a.weights), bits(&b.weights));
    assert_eq!(a.slots.len(), b.slots.len());
    for (x, y) in a.slots.iter().zip(&b.slots) {
        assert_eq!(bits(x), bits(y));
    }
    assert_eq!(a.pending.len(), b.pending.len());
    for ((ra, x), (rb, y)) in a.pending.iter().zip(&b.pending) {
        assert_eq!(ra, rb);
        assert_eq!(bits(x), bits(y));
    }
}

fn store(dir: &Path, keep: usize) -> CheckpointStore {
    CheckpointStore::new(dir.join("shard-2"), keep, CheckpointKey::from_bytes(KEY))
}

type Loaded = (ShardSnapshot, Vec<(PathBuf, CheckpointError)>);

fn load(s: &CheckpointStore) -> Result<Option<Loaded>, CheckpointError> {
    s.load_latest(HASH, 2, RANGE)
}

/// Writes versions 1 and 2, damages version 2 with `damage`, and returns the load result.
fn fall_back_after(
    damage: impl FnOnce(&Path),
) -> (ShardSnapshot, Vec<(PathBuf, CheckpointError)>, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path(), 3);
    s.write(&snapshot(1)).unwrap();
    let newest = s.write(&snapshot(2)).unwrap();
    damage(&newest);
    let (snap, skipped) = load(&s).unwrap().expect("the older checkpoint");
    assert_same(&snap, &snapshot(1));
    (snap, skipped, newest)
}

/// Edits the manifest body and re-signs it with `key`, as a crafted manifest from a key holder would be (the format
/// 2 MAC, computed here independently of the writer).
fn rewrite_manifest_with(dir: &Path, key: &[u8], edit: impl FnOnce(&mut Value)) {
    let path = dir.join(MANIFEST_FILE);
    let mut envelope: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    edit(&mut envelope["body"]);
    let mut msg = MAC_CONTEXT.to_vec();
    msg.extend(serde_json::to_vec(&envelope["body"]).unwrap());
    let tag = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), &msg);
    envelope["hmac_sha256"] = hex(tag.as_ref()).into();
    fs::write(&path, serde_json::to_vec(&envelope).unwrap()).unwrap();
}

/// [`rewrite_manifest_with`] the store's own key: what passes authentication and must still be checked.
fn rewrite_manifest(dir: &Path, edit: impl FnOnce(&mut Value)) {
    rewrite_manifest_with(dir, &KEY, edit)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex(digest::digest(&digest::SHA256, bytes).as_ref())
}

/// Replaces data file 0 (the weights) with `values`, updating its size and digest in the manifest body.
fn replace_weights(dir: &Path, values: &[f32], body: &mut Value) {
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let stored = zstd::bulk::compress(&raw, 1).unwrap();
    fs::write(dir.join(WEIGHTS_FILE), &stored).unwrap();
    body["files"][0]["bytes"] = (stored.len() as u64).into();
    body["files"][0]["digest"] = sha256_hex(&stored).into();
}

#[test]
fn save_then_load_is_bit_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path(), 3);
    let snap = snapshot(7);
    let path = s.write(&snap).unwrap();
    assert_eq!(
        path,
        tmp.path().join("shard-2").join("v00000000000000000007")
    );
    let (loaded, skipped) = load(&s).unwrap().expect("a checkpoint");
    assert!(skipped.is_empty());
    assert_same(&loaded, &snap);
}

#[test]
fn sgd_snapshot_without_slots_and_empty_range_round_trip() {
    let tmp = tempfile::tempdir().unwrap();
    let s = CheckpointStore::new(tmp.path().to_path_buf(), 2, CheckpointKey::from_bytes(KEY));
    let mut snap = snapshot(1);
    snap.slots.clear();
    s.write(&snap).unwrap();
    let (loaded, _) = load(&s).unwrap().unwrap();
    assert_same(&loaded, &snap);

    let empty = ShardSnapshot {
        range: (5, 5),
        weights: vec![],
        slots: vec![vec![]],
        version: 2,
        ..snap
    };
    s.write(&empty).unwrap();
    let (loaded, _) = s.load_latest(HASH, 2, (5, 5)).unwrap().unwrap();
    assert_same(&loaded, &empty);
}

#[test]
fn nothing_on_disk_loads_as_none() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path(), 3);
    assert!(load(&s).unwrap().is_none());
    assert!(s.list().unwrap().is_empty());
}

#[test]
fn keep_three_leaves_exactly_the_newest_three() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path(), 3);
    for v in [1, 2, 3, 4, 10, 5] {
        s.write(&snapshot(v)).unwrap();
    }
    let versions: Vec<u64> = s.list().unwrap().into_iter().map(|(v, _)| v).collect();
    assert_eq!(versions, vec![10, 5, 4]);
    assert_eq!(
        fs::read_dir(s.dir()).unwrap().count(),
        3,
        "no other entries remain"
    );
    let (latest, _) = load(&s).unwrap().unwrap();
    assert_eq!(latest.version, 10);
}

#[test]
fn rewriting_a_version_replaces_it() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path(), 3);
    s.write(&snapshot(4)).unwrap();
    let mut again = snapshot(4);
    again.clocks = vec![(9, 9)];
    s.write(&again).unwrap();
    assert_eq!(s.list().unwrap().len(), 1);
    assert_same(&load(&s).unwrap().unwrap().0, &again);
}

#[test]
fn truncated_weights_fall_back_to_the_previous_checkpoint() {
    let (_, skipped, newest) = fall_back_after(|dir| {
        let f = fs::OpenOptions::new()
            .write(true)
            .open(dir.join(WEIGHTS_FILE))
            .unwrap();
        let len = f.metadata().unwrap().len();
        f.set_len(len - 10).unwrap();
    });
    assert_eq!(skipped.len(), 1);
    assert_eq!(skipped[0].0, newest);
    assert!(
        matches!(&skipped[0].1, CheckpointError::Truncated { file, .. } if file == WEIGHTS_FILE),
        "{:?}",
        skipped[0].1
    );
}

#[test]
fn a_flipped_bit_in_the_weights_falls_back() {
    let (_, skipped, _) = fall_back_after(|dir| {
        let path = dir.join(WEIGHTS_FILE);
        let mut bytes = fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x10;
        fs::write(&path, bytes).unwrap();
    });
    assert!(
        matches!(&skipped[0].1, CheckpointError::ChecksumMismatch { file } if file == WEIGHTS_FILE),
        "{:?}",
        skipped[0].1
    );
}

#[test]
fn a_garbled_manifest_falls_back() {
    let (_, skipped, _) = fall_back_after(|dir| {
        let path = dir.join(MANIFEST_FILE);
        let mut bytes = fs::read(&path).unwrap();
        bytes[20..40].fill(b'#');
        fs::write(&path, bytes).unwrap();
    });
    assert!(
        matches!(&skipped[0].1, CheckpointError::Manifest { .. }),
        "{:?}",
        skipped[0].1
    );
}

#[test]
fn a_manifest_edited_into_other_valid_json_fails_its_mac() {
    let (_, skipped, _) = fall_back_after(|dir| {
        let path = dir.join(MANIFEST_FILE);
        let text = fs::read_to_string(&path).unwrap();
        // The optimizer step count of version 2 is 1; make it 0 without touching the MAC.
        let edited = text.replacen("\"opt_steps\": 1", "\"opt_steps\": 0", 1);
        assert_ne!(text, edited);
        fs::write(&path, edited).unwrap();
    });
    assert!(
        matches!(&skipped[0].1, CheckpointError::Forged),
        "{:?}",
        skipped[0].1
    );
}

#[test]
fn forged_weights_with_recomputed_checksums_fall_back() {
    // What defeated format 1: new (finite) weights, the file's size and digest recomputed, the manifest re-checksummed
    // by someone without the key. Here that is a MAC under another key.
    let (_, skipped, _) = fall_back_after(|dir| {
        rewrite_manifest_with(dir, &[9; 32], |body| {
            replace_weights(dir, &vec![1e3; (RANGE.1 - RANGE.0) as usize], body)
        });
    });
    assert!(
        matches!(&skipped[0].1, CheckpointError::Forged),
        "{:?}",
        skipped[0].1
    );
    // The same with the MAC left as the writer made it.
    let (_, skipped, _) = fall_back_after(|dir| {
        let path = dir.join(MANIFEST_FILE);
        let mut envelope: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        replace_weights(
            dir,
            &vec![1e3; (RANGE.1 - RANGE.0) as usize],
            &mut envelope["body"],
        );
        fs::write(&path, serde_json::to_vec(&envelope).unwrap()).unwrap();
    });
    assert!(
        matches!(&skipped[0].1, CheckpointError::Forged),
        "{:?}",
        skipped[0].1
    );
}

#[test]
fn a_checkpoint_written_with_another_key_is_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path(), 3);
    s.write(&snapshot(1)).unwrap();
    // Another shard's (or another cluster's) key writes a newer, otherwise perfect checkpoint into the same root.
    let foreign =
        CheckpointStore::new(s.dir().to_path_buf(), 3, CheckpointKey::from_bytes([8; 32]));
    let newest = foreign.write(&snapshot(2)).unwrap();
    let (snap, skipped) = load(&s).unwrap().expect("our own checkpoint");
    assert_same(&snap, &snapshot(1));
    assert_eq!(skipped.len(), 1);
    assert_eq!(skipped[0].0, newest);
    assert!(
        matches!(&skipped[0].1, CheckpointError::Forged),
        "{:?}",
        skipped[0].1
    );
    // And the foreign store cannot load ours.
    assert!(matches!(
        foreign.load_latest(HASH, 2, RANGE),
        Ok(Some((ref snap, _))) if snap.version == snapshot(2).version
    ));
    fs::remove_dir_all(&newest).unwrap();
    assert!(matches!(
        foreign.load_latest(HASH, 2, RANGE),
        Err(CheckpointError::NoneUsable { .. })
    ));
}

#[test]
fn an_unauthenticated_format_1_checkpoint_is_not_trusted() {
    let (_, skipped, _) = fall_back_after(|dir| {
        // A format 1 manifest: the same body with a CRC-32 and no MAC, as the previous release wrote it.
        let path = dir.join(MANIFEST_FILE);
        let envelope: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        let mut body = envelope["body"].clone();
        body["format_version"] = 1.into();
        let crc = crc32fast::hash(&serde_json::to_vec(&body).unwrap());
        let old = serde_json::json!({ "body": body, "crc32": crc });
        fs::write(&path, serde_json::to_vec(&old).unwrap()).unwrap();
    });
    assert!(
        matches!(
            &skipped[0].1,
            CheckpointError::Unauthenticated { format_version: 1 }
        ),
        "{:?}",
        skipped[0].1
    );
    assert!(skipped[0].1.to_string().contains("not authenticated"));
}

#[test]
fn non_finite_weights_or_state_under_a_valid_mac_fall_back() {
    let n = (RANGE.1 - RANGE.0) as usize;
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let (_, skipped, _) = fall_back_after(|dir| {
            let mut values = snapshot(2).weights;
            values[n / 2] = bad;
            rewrite_manifest(dir, |body| replace_weights(dir, &values, body));
        });
        assert!(
            matches!(&skipped[0].1, CheckpointError::BadValue { reason } if reason.contains("weights[501]")),
            "{bad}: {:?}",
            skipped[0].1
        );
    }
    // An optimizer slot (data file 2, Adam's second moment) holding a NaN.
    let (_, skipped, _) = fall_back_after(|dir| {
        let mut values = snapshot(2).slots[1].clone();
        values[0] = f32::NAN;
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let stored = zstd::bulk::compress(&raw, 1).unwrap();
        fs::write(dir.join("slot1.f32.zst"), &stored).unwrap();
        rewrite_manifest(dir, |body| {
            body["files"][2]["bytes"] = (stored.len() as u64).into();
            body["files"][2]["digest"] = sha256_hex(&stored).into();
        });
    });
    assert!(
        matches!(&skipped[0].1, CheckpointError::BadValue { reason } if reason.contains("optimizer slot 1")),
        "{:?}",
        skipped[0].1
    );
}

#[test]
fn clocks_and_counters_out_of_bounds_under_a_valid_mac_fall_back() {
    type Edit = (&'static str, fn(&mut Value));
    let edits: [Edit; 6] = [
        ("clock past MAX_CLOCK", |b| {
            b["clocks"][0][1] = (MAX_CLOCK + 1).into()
        }),
        ("clock 2^63", |b| b["clocks"][1][1] = (1u64 << 63).into()),
        ("evicted clock past MAX_CLOCK", |b| {
            b["evicted"][0][1] = u64::MAX.into()
        }),
        ("worker listed twice", |b| b["evicted"][0][0] = 3.into()),
        ("more steps than updates", |b| {
            b["opt_steps"] = (b["version"].as_u64().unwrap() + 1).into()
        }),
        ("version 2^63 (directory renamed to match)", |b| {
            b["version"] = (1u64 << 63).into()
        }),
    ];
    for (what, edit) in edits {
        let (_, skipped, _) = fall_back_after(|dir| {
            rewrite_manifest(dir, edit);
            let renamed = dir.with_file_name(tether_server::checkpoint::version_dir_name(1 << 63));
            if what.starts_with("version") {
                fs::rename(dir, renamed).unwrap();
            }
        });
        assert!(
            matches!(&skipped[0].1, CheckpointError::BadValue { .. }),
            "{what}: {:?}",
            skipped[0].1
        );
    }
}

#[test]
fn the_writer_refuses_what_the_loader_would_refuse_and_keeps_the_good_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path(), 1);
    let good = s.write(&snapshot(1)).unwrap();
    let mut nan = snapshot(2);
    nan.weights[7] = f32::NAN;
    let mut far = snapshot(3);
    far.evicted.push((99, MAX_CLOCK + 1));
    let mut nan_slot = snapshot(4);
    nan_slot.slots[0][0] = f32::INFINITY;
    for bad in [nan, far, nan_slot] {
        assert!(
            matches!(s.write(&bad), Err(CheckpointError::BadValue { .. })),
            "written: version {}",
            bad.version
        );
    }
    // keep = 1: a refused write must not have pruned the good one.
    assert_eq!(s.list().unwrap(), vec![(snapshot(1).version, good)]);
    assert_same(&load(&s).unwrap().unwrap().0, &snapshot(1));
}

#[test]
fn a_deleted_file_falls_back() {
    let (_, skipped, _) =
        fall_back_after(|dir| fs::remove_file(dir.join("slot1.f32.zst")).unwrap());
    assert!(
        matches!(&skipped[0].1, CheckpointError::MissingFile { file } if file == "slot1.f32.zst"),
        "{:?}",
        skipped[0].1
    );
}

#[test]
fn a_deleted_manifest_falls_back() {
    let (_, skipped, _) = fall_back_after(|dir| fs::remove_file(dir.join(MANIFEST_FILE)).unwrap());
    assert!(
        matches!(&skipped[0].1, CheckpointError::MissingFile { file } if file == MANIFEST_FILE)
    );
}

#[test]
fn a_renamed_version_directory_is_rejected() {
    let (_, skipped, _) = fall_back_after(|dir| {
        fs::rename(dir, dir.with_file_name("v00000000000000000009")).unwrap();
    });
    assert!(
        matches!(&skipped[0].1, CheckpointError::Manifest { .. }),
        "{:?}",
        skipped[0].1
    );
}

#[test]
fn wrong_layout_shard_or_range_is_not_loaded() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path(), 3);
    s.write(&snapshot(1)).unwrap();
    let only_reason = |r: Result<Option<Loaded>, CheckpointError>| match r {
        Err(CheckpointError::NoneUsable { mut skipped }) => {
            assert_eq!(skipped.len(), 1);
            skipped.remove(0).1
        }
        other => panic!("expected NoneUsable, got {other:?}"),
    };
    assert!(matches!(
        only_reason(s.load_latest(HASH ^ 1, 2, RANGE)),
        CheckpointError::LayoutMismatch { expected, found } if expected == HASH ^ 1 && found == HASH
    ));
    assert!(matches!(
        only_reason(s.load_latest(HASH, 3, RANGE)),
        CheckpointError::ShardMismatch {
            expected: 3,
            found: 2
        }
    ));
    assert!(matches!(
        only_reason(s.load_latest(HASH, 2, (1000, 2004))),
        CheckpointError::RangeMismatch { .. }
    ));
    // The right identity still loads.
    assert!(load(&s).unwrap().is_some());
}

#[test]
fn stale_tmp_directories_are_ignored_by_load_and_removed_by_write() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path(), 3);
    let first = s.write(&snapshot(1)).unwrap();
    // An interrupted write of a newer version: complete-looking content under a temporary name, plus junk.
    let stale = s.dir().join(".tmp-v5-999-0");
    fs::create_dir(&stale).unwrap();
    for entry in fs::read_dir(&first).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), stale.join(entry.file_name())).unwrap();
    }
    fs::create_dir(s.dir().join(".tmp-v6-999-1")).unwrap();
    fs::write(s.dir().join(".tmp-v6-999-1").join(MANIFEST_FILE), b"{").unwrap();

    assert_eq!(s.list().unwrap(), vec![(1, first.clone())]);
    let (snap, skipped) = load(&s).unwrap().unwrap();
    assert_eq!(snap.version, 1);
    assert!(skipped.is_empty());

    s.write(&snapshot(2)).unwrap();
    let names: Vec<String> = fs::read_dir(s.dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.starts_with(".tmp-")), "{names:?}");
    assert_eq!(names.len(), 2);
}

#[test]
fn an_inconsistent_snapshot_is_refused_on_write() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path(), 3);
    let mut short = snapshot(1);
    short.weights.pop();
    assert!(matches!(
        s.write(&short),
        Err(CheckpointError::Format { .. })
    ));
    let mut bad_slot = snapshot(1);
    bad_slot.slots[1].push(0.0);
    assert!(matches!(
        s.write(&bad_slot),
        Err(CheckpointError::Format { .. })
    ));
    assert!(s.list().unwrap().is_empty());
}

#[test]
fn a_huge_declared_size_is_refused_without_allocating_it() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path(), 3);
    s.write(&snapshot(1)).unwrap();
    let newest = s.write(&snapshot(2)).unwrap();
    rewrite_manifest(&newest, |body| {
        body["files"][0]["bytes"] = (1u64 << 50).into()
    });

    LARGEST.with(|c| c.set(0));
    let (snap, skipped) = load(&s).unwrap().unwrap();
    let largest = LARGEST.with(Cell::get);
    assert_eq!(snap.version, 1);
    assert!(
        matches!(&skipped[0].1, CheckpointError::Format { .. }),
        "{:?}",
        skipped[0].1
    );
    // The expected content is 1003 values (4 KiB per file); nothing near the declared petabyte may be requested.
    assert!(
        largest < 64 * 1024,
        "largest allocation during load: {largest} bytes"
    );
}

#[test]
fn a_decompression_bomb_is_stopped_at_the_expected_size() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path(), 3);
    s.write(&snapshot(1)).unwrap();
    let newest = s.write(&snapshot(2)).unwrap();
    // 16 MiB of zeros compresses to a few hundred bytes, with a matching manifest entry.
    let bomb = zstd::bulk::compress(&vec![0u8; 16 << 20], 1).unwrap();
    fs::write(newest.join(WEIGHTS_FILE), &bomb).unwrap();
    rewrite_manifest(&newest, |body| {
        body["files"][0]["bytes"] = (bomb.len() as u64).into();
        body["files"][0]["digest"] = sha256_hex(&bomb).into();
    });

    LARGEST.with(|c| c.set(0));
    let (snap, skipped) = load(&s).unwrap().unwrap();
    let largest = LARGEST.with(Cell::get);
    assert_eq!(snap.version, 1);
    assert!(
        matches!(&skipped[0].1, CheckpointError::Format { .. }),
        "{:?}",
        skipped[0].1
    );
    assert!(
        largest < 64 * 1024,
        "largest allocation during load: {largest} bytes"
    );
}

#[test]
fn a_crafted_file_list_cannot_name_other_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path(), 3);
    let newest = s.write(&snapshot(1)).unwrap();
    rewrite_manifest(&newest, |body| {
        body["files"][0]["name"] = "../../etc/passwd".into()
    });
    match load(&s) {
        Err(CheckpointError::NoneUsable { skipped }) => {
            assert!(
                matches!(skipped[0].1, CheckpointError::Format { .. }),
                "{:?}",
                skipped[0].1
            )
        }
        other => panic!("expected NoneUsable, got {other:?}"),
    }
}

#[test]
fn every_corrupt_checkpoint_is_reported_when_none_is_usable() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path(), 3);
    for v in 1..=2 {
        let dir = s.write(&snapshot(v)).unwrap();
        fs::write(dir.join(WEIGHTS_FILE), b"not zstd").unwrap();
    }
    match load(&s) {
        Err(CheckpointError::NoneUsable { skipped }) => {
            assert_eq!(skipped.len(), 2);
            assert!(skipped[0].0.ends_with("v00000000000000000002"));
            assert!(skipped[1].0.ends_with("v00000000000000000001"));
        }
        other => panic!("expected NoneUsable, got {other:?}"),
    }
}

/// The open rounds' sums of a shard stepping at round close round-trip as data files after the slots; a manifest
/// that names more rounds than it has files, or a sum of the wrong length, is refused.
#[test]
fn open_rounds_sums_round_trip_and_a_manifest_that_miscounts_them_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(tmp.path(), 3);
    let n = (RANGE.1 - RANGE.0) as usize;
    let mut snap = snapshot(1);
    snap.pending = vec![
        (7, (0..n).map(|i| i as f32 * -1e-3).collect()),
        (8, vec![0.25; n]),
    ];
    let dir = s.write(&snap).unwrap();
    assert!(dir.join("pend1.f32.zst").exists());
    let (loaded, _) = load(&s).unwrap().unwrap();
    assert_same(&loaded, &snap);

    let mut short = snapshot(2);
    short.pending = vec![(9, vec![0.0; n - 1])];
    assert!(s.write(&short).is_err(), "a sum shorter than the range");
    let mut unordered = snapshot(2);
    unordered.pending = vec![(9, vec![0.0; n]), (9, vec![0.0; n])];
    assert!(s.write(&unordered).is_err(), "a round twice");

    rewrite_manifest_with(&dir, &KEY, |body| {
        body["pending_rounds"] = serde_json::json!([7, 8, 9]);
    });
    assert!(
        matches!(load(&s), Err(CheckpointError::NoneUsable { .. })),
        "three rounds named, two files"
    );
}
