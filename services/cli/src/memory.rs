//! Returning freed heap to the operating system.
//!
//! glibc keeps memory a process freed for reuse, so a server's resident memory follows the
//! largest amount it ever held at once (a burst of slow streams, a batch of long prompts), not
//! what it holds now. Servers trim the heap every few seconds, off the async threads, so their
//! resident memory (what a container's memory limit counts) comes back down after a burst.

use std::time::Duration;

/// How often the heap is trimmed.
const TRIM_EVERY: Duration = Duration::from_secs(5);

/// Starts trimming the heap every [`TRIM_EVERY`] for as long as the runtime runs (glibc only;
/// elsewhere nothing).
pub fn spawn_heap_trimmer() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    tokio::spawn(async {
        let mut every = tokio::time::interval(TRIM_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            // SAFETY: malloc_trim only returns free pages of glibc's own heap to the kernel; it
            // takes the allocator's locks like any allocation and touches no memory in use.
            let _ = tokio::task::spawn_blocking(|| unsafe { libc::malloc_trim(0) }).await;
        }
    });
}
