//! The metrics exporter in a process that has run out of file descriptors: every accept fails with EMFILE while
//! connections wait in the listen backlog. The exporter must back off instead of retrying at once (which burned a
//! core and starved the shard's checkpoints of CPU), and must answer a scrape once descriptors are free again.
//! Alone in its test binary because it lowers the whole process's `RLIMIT_NOFILE`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::registry::Registry;
use tether_common::metrics::{serve, ServerMetrics, ACCEPT_BACKOFF_MAX};

/// Idle connections queued in the backlog, beyond what the lowered limit lets the exporter accept.
const CLIENTS: usize = 40;
/// Descriptors left free for the exporter under the lowered limit.
const ROOM: u64 = 4;
/// How long the CPU time of the process is measured while accepts fail.
const MEASURE: Duration = Duration::from_secs(2);

/// CPU time (user + system) of the whole process, in seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes the struct it is given, which is zero-initialised plain data.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_SELF, &mut usage), 0);
        usage
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// How many descriptors the process has open (not counting the one that lists them). New descriptors take the
/// lowest free numbers, so a limit of this many plus k leaves room for at most k more, wherever the open ones lie.
fn open_descriptors() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as u64 - 1
}

/// Sets the soft `RLIMIT_NOFILE`; returns the previous limits.
fn set_soft_nofile(soft: u64) -> libc::rlimit {
    // SAFETY: getrlimit/setrlimit only read and write the struct they are given.
    unsafe {
        let mut old: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut old), 0);
        let new = libc::rlimit {
            rlim_cur: soft as libc::rlim_t,
            rlim_max: old.rlim_max,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &new), 0);
        old
    }
}

fn scrape(addr: SocketAddr) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    body.starts_with("HTTP/1.1 200 OK").then_some(body)
}

#[test]
fn an_exporter_out_of_descriptors_backs_off_and_answers_once_they_are_free() {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    // The exporter runs on a current-thread runtime of its own thread: its accept task cannot run before the clients
    // below are queued, and if it spun, this thread would still measure and fail the test instead of hanging.
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut reg = Registry::default();
            ServerMetrics::register(&mut reg);
            let (addr, _task) = serve("127.0.0.1:0".parse().unwrap(), Arc::new(reg))
                .await
                .unwrap();
            // Completed by the kernel, waiting in the backlog: nothing has been accepted yet.
            let clients: Vec<TcpStream> = (0..CLIENTS)
                .map(|_| TcpStream::connect(addr).unwrap())
                .collect();
            let old = set_soft_nofile(open_descriptors() + ROOM);
            ready_tx.send((addr, old)).unwrap();
            // Yield to the exporter until the test is done measuring, then let the clients go.
            let _ = release_rx.await;
            drop(clients);
            std::future::pending::<()>().await;
        });
    });
    let (addr, old) = ready_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the exporter did not start");
    let before = cpu_seconds();
    std::thread::sleep(MEASURE);
    let spent = cpu_seconds() - before;
    // SAFETY: setrlimit only reads the struct it is given.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &old) }, 0);
    let _ = release_tx.send(());
    assert!(
        spent < 0.3,
        "the exporter spent {spent:.2} CPU-s in {MEASURE:?} while out of descriptors: it retries accept at once"
    );
    // With descriptors free again, the next accept after at most one pause succeeds and a scrape is answered.
    let deadline = Instant::now() + ACCEPT_BACKOFF_MAX + Duration::from_secs(10);
    let mut answer = None;
    while answer.is_none() && Instant::now() < deadline {
        answer = scrape(addr);
        if answer.is_none() {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let body = answer.expect("no scrape answered once descriptors were free");
    assert!(body.contains("tether_updates_applied_total"), "{body}");
}
