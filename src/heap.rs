//! The process heap's settings: how many glibc malloc arenas it may make.
//!
//! glibc gives each thread that meets a busy arena a new one, up to eight
//! per core, and an arena keeps what is freed in it for its own threads.
//! A server's request bodies are parsed and answered on whichever of the
//! runtime's and blocking pool's threads is free, so a burst of large
//! bodies touches fresh pages in arena after arena: measured on 2 cores,
//! 8 concurrent 1 MB Responses bodies raised the peak RSS 45 MB with the
//! default against 20 MB with four arenas, the heap's own peak being
//! ~21 MB either way (tests/memory.rs). Two arenas a core keeps threads
//! from queueing on one lock and the RSS where the heap is.

use std::sync::Once;

/// Caps the malloc arenas at two a core (glibc only; elsewhere nothing).
/// Idempotent; best called before the process starts its threads, as
/// arenas already made stay.
pub fn limit_arenas() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
            let arenas = i32::try_from(2 * cores).unwrap_or(i32::MAX);
            // SAFETY: mallopt only sets a malloc parameter; any value is
            // accepted or refused (a zero return), never unsound.
            unsafe {
                libc::mallopt(libc::M_ARENA_MAX, arenas);
            }
        }
    });
}
