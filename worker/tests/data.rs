//! Data loading: IDX round trips and hostile IDX files, the real Fashion-MNIST directory, the embedded digits,
//! CSV and libsvm parsing with line-numbered errors, `load` dispatch, partitioning/shuffling/batching, and a
//! worker's share read by rows (the same batches as the whole set, hostile files refused).

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use flate2::write::GzEncoder;
use flate2::Compression;
use tether_common::config::{DataConfig, DatasetKind};
use tether_worker::data::{
    digits, digits_all, load, load_configured_share, load_csv, load_idx_dir, load_idx_dir_share,
    load_idx_pair, load_idx_share, load_libsvm, parse_csv, parse_libsvm, Batcher, DataError,
    DataSource, Dataset, Partition,
};

fn idx_images(n: u32, rows: u32, cols: u32, pixel: impl Fn(usize) -> u8) -> Vec<u8> {
    let mut b = vec![0, 0, 8, 3];
    for d in [n, rows, cols] {
        b.extend_from_slice(&d.to_be_bytes());
    }
    b.extend((0..(n * rows * cols) as usize).map(pixel));
    b
}

fn idx_labels(labels: &[u8]) -> Vec<u8> {
    let mut b = vec![0, 0, 8, 1];
    b.extend_from_slice(&(labels.len() as u32).to_be_bytes());
    b.extend_from_slice(labels);
    b
}

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut e = GzEncoder::new(Vec::new(), Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Writes a 4-file IDX directory (train 6 images of 2×3, test 2), raw or gzipped.
fn write_idx_dir(dir: &Path, gzip: bool) {
    let enc = |b: Vec<u8>| if gzip { gz(&b) } else { b };
    let sfx = if gzip { ".gz" } else { "" };
    write(
        dir,
        &format!("train-images-idx3-ubyte{sfx}"),
        &enc(idx_images(6, 2, 3, |i| (i * 7 % 256) as u8)),
    );
    write(
        dir,
        &format!("train-labels-idx1-ubyte{sfx}"),
        &enc(idx_labels(&[0, 1, 2, 3, 4, 2])),
    );
    write(
        dir,
        &format!("t10k-images-idx3-ubyte{sfx}"),
        &enc(idx_images(2, 2, 3, |i| (255 - i) as u8)),
    );
    write(
        dir,
        &format!("t10k-labels-idx1-ubyte{sfx}"),
        &enc(idx_labels(&[4, 0])),
    );
}

#[test]
fn idx_round_trip_raw_and_gz() {
    for gzip in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        write_idx_dir(dir.path(), gzip);
        let (train, test) = load_idx_dir(dir.path()).unwrap();
        assert_eq!((train.len(), train.features, train.classes), (6, 6, 5));
        assert_eq!((test.len(), test.features, test.classes), (2, 6, 5));
        assert_eq!(train.y, vec![0, 1, 2, 3, 4, 2]);
        assert_eq!(test.y, vec![4, 0]);
        for (i, &v) in train.x.iter().enumerate() {
            assert_eq!(v, (i * 7 % 256) as f32 / 255.0);
        }
        assert_eq!(test.row(0)[0], 1.0);
        assert_eq!(
            test.row(1),
            &[
                249.0 / 255.0,
                248.0 / 255.0,
                247.0 / 255.0,
                246.0 / 255.0,
                245.0 / 255.0,
                244.0 / 255.0
            ][..]
        );
    }
}

fn expect_format_error(result: Result<Dataset, DataError>, file: &Path, needle: &str) {
    match result {
        Err(e @ DataError::Format { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains(&file.display().to_string()),
                "{msg} does not name {}",
                file.display()
            );
            assert!(msg.contains(needle), "{msg} does not mention {needle:?}");
        }
        other => panic!(
            "expected a format error for {}, got {other:?}",
            file.display()
        ),
    }
}

#[test]
fn hostile_idx_files_give_typed_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let labels = write(dir.path(), "labels", &idx_labels(&[1, 2, 3]));
    let good = idx_images(3, 2, 2, |i| i as u8);

    let mut truncated = good.clone();
    truncated.pop();
    let f = write(dir.path(), "truncated", &truncated);
    expect_format_error(load_idx_pair(&f, &labels), &f, "truncated");

    let f = write(dir.path(), "trailing", &[good.clone(), vec![0]].concat());
    expect_format_error(load_idx_pair(&f, &labels), &f, "trailing");

    let mut bad_magic = good.clone();
    bad_magic[0] = 0x42;
    let f = write(dir.path(), "badmagic", &bad_magic);
    expect_format_error(load_idx_pair(&f, &labels), &f, "magic");

    let mut bad_type = good.clone();
    bad_type[2] = 0x0d; // float
    let f = write(dir.path(), "badtype", &bad_type);
    expect_format_error(load_idx_pair(&f, &labels), &f, "element type");

    // Absurd dims: 4e9 × 4e9 × 4e9 with a 10-byte payload must be rejected before any allocation.
    let mut absurd = vec![0, 0, 8, 3];
    for _ in 0..3 {
        absurd.extend_from_slice(&u32::MAX.to_be_bytes());
    }
    absurd.extend_from_slice(&[0; 10]);
    let f = write(dir.path(), "absurd", &absurd);
    expect_format_error(load_idx_pair(&f, &labels), &f, "absurd");

    // Plausible-looking dims that do not match the file length.
    let mut lying = vec![0, 0, 8, 3];
    for d in [60_000u32, 28, 28] {
        lying.extend_from_slice(&d.to_be_bytes());
    }
    lying.extend_from_slice(&[0; 100]);
    let f = write(dir.path(), "lying.gz", &gz(&lying));
    expect_format_error(load_idx_pair(&f, &labels), &f, "truncated");

    let f = write(dir.path(), "short", &[0, 0, 8]);
    expect_format_error(load_idx_pair(&f, &labels), &f, "too short");

    let f = write(dir.path(), "header-cut", &[0, 0, 8, 3, 0, 0, 0, 1]);
    expect_format_error(load_idx_pair(&f, &labels), &f, "truncated header");

    // Labels given as images and vice versa.
    let images = write(dir.path(), "images", &good);
    expect_format_error(load_idx_pair(&labels, &labels), &labels, "images need");
    expect_format_error(load_idx_pair(&images, &images), &images, "labels need");

    // Count mismatch between images and labels.
    let four = write(dir.path(), "four-labels", &idx_labels(&[0, 1, 2, 3]));
    expect_format_error(
        load_idx_pair(&images, &four),
        &four,
        "4 labels for 3 images",
    );

    // A corrupt gzip stream is an I/O error naming the file.
    let mut corrupt = gz(&good);
    let mid = corrupt.len() / 2;
    corrupt[mid..].iter_mut().for_each(|b| *b = !*b);
    let f = write(dir.path(), "corrupt.gz", &corrupt);
    match load_idx_pair(&f, &labels) {
        Err(e @ (DataError::Io { .. } | DataError::Format { .. })) => {
            assert!(e.to_string().contains("corrupt.gz"), "{e}")
        }
        other => panic!("expected an error, got {other:?}"),
    }

    // Every prefix of a valid file fails cleanly (no panic).
    for cut in 0..good.len() {
        let f = write(dir.path(), "prefix", &good[..cut]);
        assert!(
            load_idx_pair(&f, &labels).is_err(),
            "prefix of {cut} bytes accepted"
        );
    }
}

#[test]
fn missing_idx_dir_or_file_is_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    assert!(matches!(
        load_idx_dir(&missing),
        Err(DataError::NotFound { .. })
    ));
    write_idx_dir(dir.path(), false);
    std::fs::remove_file(dir.path().join("t10k-labels-idx1-ubyte")).unwrap();
    match load_idx_dir(dir.path()) {
        Err(e @ DataError::NotFound { .. }) => {
            assert!(e.to_string().contains("t10k-labels-idx1-ubyte"), "{e}")
        }
        other => panic!("expected NotFound, got {other:?}"),
    }
    let cfg = DataConfig {
        dataset: DatasetKind::FashionMnist,
        path: missing,
        test_path: None,
    };
    assert!(matches!(load(&cfg), Err(DataError::NotFound { .. })));
}

#[test]
fn real_fashion_mnist_loads() {
    let dir = Path::new("/usr/share/datasets/fashion-mnist");
    if !dir.is_dir() {
        println!(
            "skipped: {} is absent (install dataset-fashion-mnist)",
            dir.display()
        );
        return;
    }
    let cfg = DataConfig {
        dataset: DatasetKind::FashionMnist,
        path: dir.to_path_buf(),
        test_path: None,
    };
    let (train, test, source) = load(&cfg).unwrap();
    assert_eq!(source, DataSource::FashionMnist(dir.to_path_buf()));
    assert_eq!(
        (train.len(), train.features, train.classes),
        (60_000, 784, 10)
    );
    assert_eq!((test.len(), test.features, test.classes), (10_000, 784, 10));
    assert_eq!(train.x.len(), 60_000 * 784);
    assert!(train.x.iter().all(|v| (0.0..=1.0).contains(v)));
    // Fashion-MNIST is balanced: 6,000 / 1,000 per class.
    assert_eq!(train.class_counts(), vec![6_000; 10]);
    assert_eq!(test.class_counts(), vec![1_000; 10]);
}

#[test]
fn embedded_digits_load_with_a_fixed_split() {
    let all = digits_all().unwrap();
    assert_eq!((all.len(), all.features, all.classes), (1_797, 64, 10));
    assert!(all.x.iter().all(|v| (0.0..=1.0).contains(v)));
    assert!(all.x.contains(&1.0));
    assert!(all.class_counts().iter().all(|&c| (170..=190).contains(&c)));
    let (train, test) = digits().unwrap();
    assert_eq!((train.len(), test.len()), (1_437, 360));
    assert_eq!(train.len() + test.len(), 1_797);
    assert_eq!(
        (train.features, train.classes, test.features, test.classes),
        (64, 10, 64, 10)
    );
    // Deterministic split.
    let (train2, test2) = digits().unwrap();
    assert_eq!(train, train2);
    assert_eq!(test, test2);
    // The two parts are a partition of the whole (compare rows as multisets of bit patterns).
    let key = |d: &Dataset, i: usize| {
        (
            d.y[i],
            d.row(i).iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        )
    };
    let mut whole: Vec<_> = (0..all.len()).map(|i| key(&all, i)).collect();
    let mut parts: Vec<_> = (0..train.len())
        .map(|i| key(&train, i))
        .chain((0..test.len()).map(|i| key(&test, i)))
        .collect();
    whole.sort();
    parts.sort();
    assert_eq!(whole, parts);
    let cfg = DataConfig {
        dataset: DatasetKind::Digits,
        path: PathBuf::from("/nonexistent"),
        test_path: None,
    };
    let (t, _, src) = load(&cfg).unwrap();
    assert_eq!(src, DataSource::Digits);
    assert_eq!(t.len(), 1_437);
}

fn line_error(r: Result<Dataset, DataError>) -> (usize, String) {
    match r {
        Err(e @ DataError::Line { line, .. }) => (line, e.to_string()),
        other => panic!("expected a line error, got {other:?}"),
    }
}

#[test]
fn csv_parses_and_rejects_bad_lines_with_line_numbers() {
    let p = Path::new("mine.csv");
    let d = parse_csv("label,a,b\n1,0.5,2\n\n# comment\n0, 1.5 ,-3\n2,0,0\n", p).unwrap();
    assert_eq!((d.len(), d.features, d.classes), (3, 2, 3));
    assert_eq!(d.x, vec![0.5, 2.0, 1.5, -3.0, 0.0, 0.0]);
    assert_eq!(d.y, vec![1, 0, 2]);
    // No header.
    assert_eq!(parse_csv("3,1\n", p).unwrap().classes, 4);

    let (line, msg) = line_error(parse_csv("label,a\n1,2\n0,x\n", p));
    assert_eq!(line, 3);
    assert!(
        msg.starts_with("mine.csv:3:") && msg.contains("column 2"),
        "{msg}"
    );
    let (line, msg) = line_error(parse_csv("1,2,3\n0,1\n", p));
    assert_eq!(line, 2);
    assert!(
        msg.contains("1 feature columns, but earlier rows have 2"),
        "{msg}"
    );
    assert_eq!(line_error(parse_csv("1,2\nfoo,1\n", p)).0, 2);
    assert_eq!(line_error(parse_csv("1,2\n-4,1\n", p)).0, 2);
    assert_eq!(line_error(parse_csv("1,2\n0,inf\n", p)).0, 2);
    assert_eq!(line_error(parse_csv("1\n", p)).0, 1);
    assert!(matches!(
        parse_csv("header\n", p),
        Err(DataError::Format { .. })
    ));
    assert!(matches!(
        load_csv(Path::new("/nonexistent/x.csv")),
        Err(DataError::Io { .. })
    ));
}

#[test]
fn libsvm_parses_and_rejects_bad_lines_with_line_numbers() {
    let p = Path::new("mine.svm");
    let d = parse_libsvm("1 1:0.5 3:2\n# c\n0 qid:4 2:-1 # trailing\n\n2\n", p, None).unwrap();
    assert_eq!((d.len(), d.features, d.classes), (3, 3, 3));
    assert_eq!(d.x, vec![0.5, 0.0, 2.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0]);
    assert_eq!(d.y, vec![1, 0, 2]);
    // A given feature count pads; binary -1/+1 labels become 0/1.
    let d = parse_libsvm("+1 1:1\n-1 2:1\n", p, Some(5)).unwrap();
    assert_eq!((d.features, d.classes), (5, 2));
    assert_eq!(d.y, vec![1, 0]);

    let (line, msg) = line_error(parse_libsvm("1 1:1\n0 0:1\n", p, None));
    assert_eq!(line, 2);
    assert!(
        msg.starts_with("mine.svm:2:") && msg.contains("1-based"),
        "{msg}"
    );
    assert_eq!(
        line_error(parse_libsvm("1 1:1\n\n0 4:1\n", p, Some(3))).0,
        3
    );
    assert_eq!(line_error(parse_libsvm("1 1:1\n0 2=1\n", p, None)).0, 2);
    assert_eq!(line_error(parse_libsvm("1 1:1\n0 2:nan\n", p, None)).0, 2);
    assert_eq!(line_error(parse_libsvm("x 1:1\n", p, None)).0, 1);
    assert_eq!(line_error(parse_libsvm("1 1:1\n-3 1:1\n", p, None)).0, 2);
    assert_eq!(line_error(parse_libsvm("1 99999999999:1\n", p, None)).0, 1);
    assert!(matches!(
        parse_libsvm("\n# nothing\n", p, None),
        Err(DataError::Format { .. })
    ));
    // A huge index in a tiny file cannot blow up the dense matrix.
    let huge = (0..5_000)
        .map(|i| format!("{} 16000000:1\n", i % 2))
        .collect::<String>();
    assert!(matches!(
        parse_libsvm(&huge, p, None),
        Err(DataError::Format { .. })
    ));
}

#[test]
fn load_dispatches_csv_and_libsvm_with_split_or_test_file() {
    let dir = tempfile::tempdir().unwrap();
    let rows: String = (0..50)
        .map(|i| format!("{},{},{}\n", i % 3, i, 100 - i))
        .collect();
    let train = write(dir.path(), "train.csv", format!("y,a,b\n{rows}").as_bytes());
    let cfg = DataConfig {
        dataset: DatasetKind::Csv,
        path: train.clone(),
        test_path: None,
    };
    let (tr, te, src) = load(&cfg).unwrap();
    assert_eq!((tr.len(), te.len()), (45, 5));
    assert_eq!((tr.classes, te.classes, tr.features), (3, 3, 2));
    assert_eq!(src.name(), "csv");
    // Standardised with the training set's statistics.
    let mean: f32 = (0..tr.len()).map(|i| tr.row(i)[0]).sum::<f32>() / tr.len() as f32;
    assert!(mean.abs() < 1e-4, "mean {mean}");
    let (tr2, te2, _) = load(&cfg).unwrap();
    assert_eq!((tr, te), (tr2, te2), "split is seeded");

    let svm_train = write(dir.path(), "a.svm", b"0 1:1\n1 2:1\n0 1:2\n1 2:3\n");
    let svm_test = write(dir.path(), "b.svm", b"1 5:1\n0 1:1\n");
    let cfg = DataConfig {
        dataset: DatasetKind::Libsvm,
        path: svm_train.clone(),
        test_path: Some(svm_test.clone()),
    };
    let (tr, te, src) = load(&cfg).unwrap();
    assert_eq!((tr.len(), te.len(), tr.features, te.features), (4, 2, 5, 5));
    assert_eq!(
        src,
        DataSource::Libsvm {
            train: svm_train,
            test: Some(svm_test)
        }
    );
    assert_eq!(
        load_libsvm(&dir.path().join("a.svm"), None)
            .unwrap()
            .features,
        2
    );
    // A bad test file is reported by its own name.
    let bad = write(dir.path(), "bad.csv", b"1,2,3\n0,1\n");
    let cfg = DataConfig {
        dataset: DatasetKind::Csv,
        path: train,
        test_path: Some(bad),
    };
    let e = load(&cfg).unwrap_err().to_string();
    assert!(e.contains("bad.csv:2:"), "{e}");
}

#[test]
fn a_rank_beyond_the_configured_workers_reads_a_share_in_its_own_order_and_moves_no_one_elses() {
    let (n, workers) = (1_000, 4u32);
    for rank in 0..workers {
        assert_eq!(
            Partition::elastic(n, rank, workers, 7).unwrap(),
            Partition::new(n, rank, workers, 7).unwrap(),
            "configured ranks keep their shares"
        );
    }
    let joiner = Partition::elastic(n, 5, workers, 7).unwrap();
    let base = Partition::new(n, 1, workers, 7).unwrap();
    assert_eq!(joiner.rank(), 5);
    assert_eq!(
        joiner.indices(),
        base.indices(),
        "rank 5 reads the share of rank 5 mod 4"
    );
    let (a, b) = (joiner.epoch_order(0), base.epoch_order(0));
    assert_ne!(a, b, "in an order of its own");
    let (mut sa, mut sb) = (a.clone(), b.clone());
    sa.sort_unstable();
    sb.sort_unstable();
    assert_eq!(sa, sb);
    assert!(matches!(
        Partition::elastic(10, 0, 0, 0),
        Err(DataError::Partition { .. })
    ));
}

#[test]
fn partitions_are_disjoint_and_cover_every_sample() {
    for n in [0usize, 1, 7, 100, 1_797] {
        for workers in 1..=5u32 {
            let mut seen = BTreeSet::new();
            let mut sizes = Vec::new();
            for rank in 0..workers {
                let p = Partition::new(n, rank, workers, 42).unwrap();
                sizes.push(p.len());
                for &i in p.indices() {
                    assert!(i < n);
                    assert!(
                        seen.insert(i),
                        "sample {i} in two partitions (n={n}, workers={workers})"
                    );
                }
            }
            assert_eq!(seen.len(), n, "union covers all (n={n}, workers={workers})");
            let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(hi - lo <= 1, "balanced: {sizes:?}");
        }
    }
    assert!(matches!(
        Partition::new(10, 3, 3, 0),
        Err(DataError::Partition { .. })
    ));
    assert!(matches!(
        Partition::new(10, 0, 0, 0),
        Err(DataError::Partition { .. })
    ));
    // The shares are random subsets, not the first n/workers indices.
    assert_ne!(
        Partition::new(100, 0, 4, 1).unwrap().indices(),
        &(0..25).collect::<Vec<_>>()[..]
    );
}

#[test]
fn epoch_shuffles_differ_and_are_reproducible() {
    let p = Partition::new(1_000, 1, 3, 9).unwrap();
    let e0 = p.epoch_order(0);
    let e1 = p.epoch_order(1);
    assert_ne!(e0, e1, "epochs differ");
    assert_eq!(
        e0,
        Partition::new(1_000, 1, 3, 9).unwrap().epoch_order(0),
        "reproducible"
    );
    assert_ne!(
        e0,
        Partition::new(1_000, 1, 3, 10).unwrap().epoch_order(0),
        "seed matters"
    );
    let mut a = e0.clone();
    let mut b = p.indices().to_vec();
    a.sort_unstable();
    b.sort_unstable();
    assert_eq!(a, b, "an epoch visits the share exactly once");
    assert_ne!(e0, p.indices(), "actually shuffled");
    // Every position sees many different samples across epochs (no stuck elements).
    let firsts: BTreeSet<usize> = (0..50).map(|e| p.epoch_order(e)[0]).collect();
    assert!(firsts.len() > 30, "{} distinct first samples", firsts.len());
}

#[test]
fn shares_and_epoch_orders_are_pinned() {
    // Reproducibility contract: values produced before the shuffle's SplitMix64 moved to `tether_common::splitmix`;
    // a change here changes which samples every worker sees, and when.
    let p = Partition::new(10, 1, 2, 7).unwrap();
    assert_eq!(p.indices(), &[3, 6, 7, 2, 5]);
    assert_eq!(p.epoch_order(3), vec![6, 3, 2, 7, 5]);
}

#[test]
fn batcher_fills_buffers_and_covers_the_epoch() {
    let data = Dataset {
        features: 2,
        classes: 10,
        x: (0..20).flat_map(|i| [i as f32, -(i as f32)]).collect(),
        y: (0..20).map(|i| i % 10).collect(),
    };
    let p = Partition::new(20, 0, 2, 5).unwrap();
    let mut b = Batcher::new(p.clone(), 4);
    assert_eq!(b.batches_per_epoch(), 3);
    let mut x = vec![0f32; 8];
    let mut y = vec![0u32; 4];
    for epoch in 0..3 {
        b.start_epoch(epoch);
        let mut visited = Vec::new();
        let mut sizes = Vec::new();
        loop {
            let rows = b.next_into(&data, &mut x, &mut y);
            if rows == 0 {
                break;
            }
            sizes.push(rows);
            for k in 0..rows {
                let i = x[2 * k] as usize;
                assert_eq!(x[2 * k + 1], -(i as f32));
                assert_eq!(y[k], (i % 10) as u32);
                visited.push(i);
            }
            assert!(sizes.len() <= 3);
        }
        assert_eq!(sizes, vec![4, 4, 2]);
        assert_eq!(visited, p.epoch_order(epoch));
    }
    // Smaller buffers bound the rows written.
    b.start_epoch(0);
    let mut small_x = vec![0f32; 3];
    assert_eq!(b.next_into(&data, &mut small_x, &mut y), 1);
}

#[test]
fn subset_and_split() {
    let d = Dataset {
        features: 1,
        classes: 2,
        x: (0..10).map(|i| i as f32).collect(),
        y: (0..10).map(|i| i % 2).collect(),
    };
    let s = d.subset(&[9, 0, 3]);
    assert_eq!(s.x, vec![9.0, 0.0, 3.0]);
    assert_eq!(s.y, vec![1, 0, 1]);
    let (tr, te) = d.split(0.1, 1);
    assert_eq!((tr.len(), te.len()), (9, 1));
    let (tr2, te2) = d.split(0.1, 2);
    assert_eq!(tr.len() + te.len(), tr2.len() + te2.len());
}

/// Every batch of `epochs` epochs, `(x bits, y)`, of a batcher over `data`.
fn batches(
    data: &Dataset,
    partition: Partition,
    batch: usize,
    epochs: u64,
) -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut b = Batcher::new(partition, batch);
    let mut x = vec![0f32; batch * data.features];
    let mut y = vec![0u32; batch];
    let mut out = Vec::new();
    for epoch in 0..epochs {
        b.start_epoch(epoch);
        loop {
            let rows = b.next_into(data, &mut x, &mut y);
            if rows == 0 {
                break;
            }
            out.push((
                x[..rows * data.features]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect(),
                y[..rows].to_vec(),
            ));
        }
    }
    out
}

#[test]
fn a_share_read_by_rows_gives_the_batches_of_the_whole_set() {
    for gzip in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let n = 103u32;
        let enc = |b: Vec<u8>| if gzip { gz(&b) } else { b };
        let images = write(
            dir.path(),
            "train-images-idx3-ubyte",
            &enc(idx_images(n, 3, 4, |i| (i * 37 % 253) as u8)),
        );
        let labels: Vec<u8> = (0..n).map(|i| (i * 7 % 10) as u8).collect();
        let labels = write(
            dir.path(),
            "train-labels-idx1-ubyte",
            &enc(idx_labels(&labels)),
        );
        let whole = load_idx_pair(&images, &labels).unwrap();
        let mut covered = BTreeSet::new();
        for workers in [1u32, 4, 7] {
            // Ranks past `workers` are elastic joiners: another rank's share in an order of their own.
            for rank in 0..workers + 2 {
                let share = load_idx_share(&images, &labels, rank, workers, 11).unwrap();
                let global = Partition::elastic(n as usize, rank, workers, 11).unwrap();
                assert_eq!(share.total, n as usize);
                assert_eq!(share.train.len(), global.len());
                assert_eq!((share.train.features, share.train.classes), (12, 10));
                assert_eq!(share.partition.rank(), rank);
                if workers == 7 && rank < 7 {
                    covered.extend(global.indices().iter().copied());
                }
                assert_eq!(
                    batches(&share.train, share.partition.clone(), 5, 3),
                    batches(&whole, global, 5, 3),
                    "workers {workers} rank {rank} gzip {gzip}"
                );
            }
        }
        assert_eq!(covered.len(), n as usize);
    }
}

#[test]
fn hostile_idx_files_read_by_share_give_typed_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let labels = write(dir.path(), "labels", &idx_labels(&[1, 2, 3]));
    let good = idx_images(3, 2, 2, |i| i as u8);
    let share = |f: &Path, l: &Path| load_idx_share(f, l, 0, 2, 1).map(|s| s.train);

    let mut truncated = good.clone();
    truncated.pop();
    let f = write(dir.path(), "truncated", &truncated);
    expect_format_error(share(&f, &labels), &f, "truncated");
    let f = write(dir.path(), "truncated.gz", &gz(&truncated));
    expect_format_error(share(&f, &labels), &f, "truncated");

    let f = write(dir.path(), "trailing", &[good.clone(), vec![0]].concat());
    expect_format_error(share(&f, &labels), &f, "trailing");

    let f = write(dir.path(), "short-header", &good[..10]);
    expect_format_error(share(&f, &labels), &f, "header");

    let mut bad_magic = good.clone();
    bad_magic[0] = 1;
    let f = write(dir.path(), "magic", &bad_magic);
    expect_format_error(share(&f, &labels), &f, "magic");

    let mut absurd = good.clone();
    absurd[4..8].copy_from_slice(&u32::MAX.to_be_bytes());
    let f = write(dir.path(), "absurd", &absurd);
    expect_format_error(share(&f, &labels), &f, "absurd");

    // Images read as labels, labels as images, and a count mismatch: each names the file at fault.
    let f = write(dir.path(), "images", &good);
    expect_format_error(share(&f, &f), &f, "labels need 1 dimension");
    expect_format_error(share(&labels, &labels), &labels, "images need 2 or 3");
    let four = write(dir.path(), "four", &idx_labels(&[1, 2, 3, 4]));
    expect_format_error(share(&f, &four), &four, "4 labels for 3 images");

    // A rank outside an empty cluster is a partition error, not a panic.
    assert!(matches!(
        load_idx_share(&f, &labels, 0, 0, 1),
        Err(DataError::Partition { .. })
    ));
}

#[test]
fn real_fashion_mnist_share_is_the_whole_sets_rows_and_only_an_evaluator_loads_the_test_set() {
    let dir = Path::new("/usr/share/datasets/fashion-mnist");
    if !dir.is_dir() {
        println!(
            "skipped: {} is absent (install dataset-fashion-mnist)",
            dir.display()
        );
        return;
    }
    let share = load_idx_dir_share(dir, 5, 64, 42).unwrap();
    let (whole, _) = load_idx_dir(dir).unwrap();
    let global = Partition::new(60_000, 5, 64, 42).unwrap();
    assert_eq!(
        share.train,
        Dataset {
            classes: whole.classes,
            ..whole.subset(global.indices())
        }
    );

    let text = format!(
        "[cluster]\nservers = [\"127.0.0.1:7000\"]\nworkers = 64\n[data]\ndataset = \"fashion-mnist\"\npath = \"{}\"\n\
         [train]\nseed = 42\n",
        dir.display()
    );
    let mut cfg = tether_common::config::Config::parse(&text, Path::new(".")).unwrap();
    let data = load_configured_share(&mut cfg, 5, false).unwrap();
    assert_eq!((data.train.len(), data.train.classes), (938, 10));
    assert!(data.test.is_none() && data.note.is_none());
    assert_eq!(data.share.as_ref().map(Partition::len), Some(938));
    let data = load_configured_share(&mut cfg, 0, true).unwrap();
    let test = data.test.expect("rank 0 evaluates");
    assert_eq!(
        (test.len(), test.features(), test.classes()),
        (10_000, 784, 10)
    );
    // Held as pixel bytes, scaled a chunk at a time into the whole-file reader's f32 values.
    let (_, dense) = load_idx_dir(dir).unwrap();
    let mut rows = 0;
    test.for_each_chunk(300, |x, y| {
        assert_eq!(x, &dense.x[rows * 784..(rows + y.len()) * 784]);
        assert_eq!(y, &dense.y[rows..rows + y.len()]);
        rows += y.len();
    });
    assert_eq!(rows, 10_000);
}

#[test]
fn without_an_idx_set_a_worker_loads_the_whole_set_and_partitions_it_itself() {
    let empty = tempfile::tempdir().unwrap();
    let text = format!(
        "[cluster]\nservers = [\"127.0.0.1:7000\"]\nworkers = 4\n[data]\ndataset = \"fashion-mnist\"\npath = \"{}\"\n",
        empty.path().join("none").display()
    );
    let mut cfg = tether_common::config::Config::parse(&text, Path::new(".")).unwrap();
    let data = load_configured_share(&mut cfg, 1, false).unwrap();
    assert_eq!(cfg.data.dataset, DatasetKind::Digits);
    assert!(data.share.is_none() && data.test.is_none() && data.note.is_some());
    assert_eq!(data.train.len(), digits().unwrap().0.len());
}
