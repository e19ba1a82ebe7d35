//! Signals as stratad's processes take them: blocked in every thread and waited for synchronously.

/// Blocks `sigs` in the calling thread and every thread it starts afterwards; returns the set to wait on.
pub fn block(sigs: &[i32]) -> libc::sigset_t {
    // SAFETY: plain signal-mask calls on a zeroed, initialized sigset.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in sigs {
            libc::sigaddset(&mut set, *s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Waits for one of the signals of `set` (blocked by [`block`]); returns it.
pub fn wait(set: &libc::sigset_t) -> i32 {
    let mut sig = 0;
    // SAFETY: `set` was initialized by `block`; `sig` is a valid out pointer.
    unsafe { libc::sigwait(set, &mut sig) };
    sig
}
