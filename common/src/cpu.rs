//! CPU time as the kernel accounts it: the calling thread's and the whole process's, in seconds. Read-only
//! queries; used by the workers' compute pools and the run reports to say how much CPU each role used.

/// CPU time (user + system) the calling thread has used, in seconds; `None` where the platform does not say.
pub fn thread_cpu_seconds() -> Option<f64> {
    // Linux: the first field of /proc/thread-self/schedstat is the thread's time on a CPU in nanoseconds.
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = s.split_whitespace().next()?.parse().ok()?;
    Some(ns as f64 * 1e-9)
}

/// CPU time (user + system) this process has used, all threads together, in seconds; `None` where unknown.
pub fn process_cpu_seconds() -> Option<f64> {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a whole `rusage` into the pointer it is given, which points to one (zeroed) value
    // owned by this frame; RUSAGE_SELF is always a valid `who`. It returns 0 on success.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: rc == 0, so getrusage initialised the value (and it was zeroed before anyway).
    let u = unsafe { u.assume_init() };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Some(secs(u.ru_utime) + secs(u.ru_stime))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Burns about `ms` of CPU on the calling thread.
    fn spin(ms: u64) -> u64 {
        let t0 = std::time::Instant::now();
        let mut x = 1u64;
        while t0.elapsed().as_millis() < u128::from(ms) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        x
    }

    #[test]
    fn busy_threads_add_cpu_time_and_idle_ones_do_not() {
        let (Some(t0), Some(p0)) = (thread_cpu_seconds(), process_cpu_seconds()) else {
            return; // not Linux
        };
        std::hint::black_box(spin(150));
        let busy = thread_cpu_seconds().unwrap() - t0;
        assert!(busy > 0.05, "a 150 ms spin counted {busy} s");
        let t1 = thread_cpu_seconds().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(150));
        let idle = thread_cpu_seconds().unwrap() - t1;
        assert!(idle < 0.05, "a 150 ms sleep counted {idle} s");
        assert!(process_cpu_seconds().unwrap() - p0 >= busy * 0.9);
    }
}
