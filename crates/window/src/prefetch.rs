//! Software prefetch: a hint to the CPU that a value will be read soon.
//!
//! A probe of a large hash index misses every cache, and waits for memory. Read ahead with
//! ordinary loads, the misses overlap only as far as the CPU's reorder window reaches: a
//! load still waiting blocks every instruction after it from retiring. A prefetch
//! instruction retires at once and leaves the line on its way, so a loop can ask for the
//! entry a record some way ahead will probe while it works on this one.
//!
//! This is the one place the workspace allows `unsafe`: the intrinsic is an `unsafe fn`
//! only because it is declared with `#[target_feature(enable = "sse")]`.

#![allow(unsafe_code)]

/// Asks the CPU to bring the cache line that holds `value` into its caches. Returns at
/// once; changes nothing a program can observe but its speed.
#[inline(always)]
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` needs SSE, which every x86_64 CPU has (it is in the target's
    // baseline, so the call compiles to PREFETCHT0 whatever the build's flags). A
    // prefetch never faults, reads nothing into the program and writes nothing, and the
    // pointer comes from a live reference anyway.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(value).cast());
    }
    // Elsewhere, nothing: the loops that prefetch work the same, without the overlap.
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}
