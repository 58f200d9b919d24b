//! The link harness against the kernel: a star of two namespaces shaped to 40 Mbit/s carries about that much UDP
//! from one node to the other (tbf drops the rest), an unshaped one carries several times more, and dropping the
//! harness deletes every namespace it made. Needs root (`ip netns`); without it the test says so and passes unless
//! `TETHER_REQUIRE_NETNS=1` (set in CI, which runs as root) makes that a failure.

use std::process::{Command, Stdio};
use std::time::Duration;

use tether_bench::netns::{is_root, Star};

const RECEIVER: &str = r#"
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 9999))
s.settimeout(0.5)
n, first, last = 0, None, None
end = time.time() + 6
while time.time() < end:
    try:
        d = s.recv(2048)
    except socket.timeout:
        if first is not None:
            break
        continue
    now = time.time()
    first = first or now
    last = now
    n += len(d)
print(n * 8 / max(last - first, 1e-3) if first else 0)
"#;

const SENDER: &str = r#"
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
buf = b"x" * 1400
end = time.time() + 1.5
while time.time() < end:
    for _ in range(64):
        try:
            s.sendto(buf, (sys.argv[1], 9999))
        except OSError:
            pass
"#;

/// Bits/s received by node 1 from node 0's blast.
fn throughput(star: &Star) -> f64 {
    let python = std::path::Path::new("python3");
    let rx = star
        .command(1, python)
        .args(["-c", RECEIVER, &Star::addr(1)])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 receiver");
    std::thread::sleep(Duration::from_millis(300));
    let tx = star
        .command(0, python)
        .args(["-c", SENDER, &Star::addr(1)])
        .status()
        .expect("python3 sender");
    assert!(tx.success());
    let out = rx.wait_with_output().expect("receiver output");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("a rate")
}

fn namespaces() -> String {
    String::from_utf8_lossy(
        &Command::new("ip")
            .args(["netns", "list"])
            .output()
            .unwrap()
            .stdout,
    )
    .to_string()
}

#[test]
fn shaped_links_carry_their_rate_and_vanish_on_drop() {
    if !is_root() {
        assert!(
            std::env::var("TETHER_REQUIRE_NETNS").is_err(),
            "TETHER_REQUIRE_NETNS is set but this is not root"
        );
        eprintln!("skipped: the link harness needs root");
        return;
    }
    let shaped = Star::up(2, Some(40_000_000)).expect("shaped star");
    let names = shaped.namespaces();
    let rate = throughput(&shaped);
    drop(shaped);
    let left = namespaces();
    for n in &names {
        assert!(
            !left.split_whitespace().any(|w| w == n),
            "{n} left behind: {left}"
        );
    }
    let open = Star::up(2, None).expect("unshaped star");
    let free = throughput(&open);
    drop(open);
    eprintln!(
        "40 Mbit/s star carried {:.1} Mbit/s; unshaped {:.1} Mbit/s",
        rate / 1e6,
        free / 1e6
    );
    assert!((30e6..=46e6).contains(&rate), "shaped rate {rate}");
    assert!(free > 3.0 * rate, "unshaped {free} vs shaped {rate}");
}
