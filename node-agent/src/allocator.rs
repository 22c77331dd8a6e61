//! One allocator arena for the whole agent.
//!
//! glibc's malloc gives a thread that finds the arenas busy one of its
//! own, up to eight per core, and each keeps what was freed in it. On the
//! bench cluster's 2 cores the agent held six or seven arenas of 4 to
//! 12 MiB: 55 to 67 MiB of RSS at 1000 NetworkPolicies over 5000 pods,
//! still 54 MiB once they were all deleted. With one arena, the same run
//! peaks at 38 MiB (`make bench-cluster`). The agent runs two runtime
//! threads and short blocking tasks; they seldom allocate at once.

/// Sets glibc's arena limit to one; call before any thread starts.
pub fn one_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only sets an allocator parameter; called from
        // `main` before any other thread exists.
        #[allow(unsafe_code)]
        let set = unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
        if set != 1 {
            log::warn!("mallopt(M_ARENA_MAX, 1) refused: memory may grow with threads");
        }
    }
}
