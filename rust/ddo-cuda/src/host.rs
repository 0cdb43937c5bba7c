//! Host memory: page-locking existing memory, owned staging buffers, parallel host copies.

use cudarc::driver::sys;
use rayon::prelude::*;

use crate::deferred::ErrorSlot;
use crate::driver::{bind_context, bind_primary, check};
use crate::error::{CudaError, Result};

/// Below this size a host copy runs on one thread.
const SERIAL_MAX: usize = 1 << 20;
/// Chunks of a parallel copy without a piece size (an even share per thread) are at least this big
/// (smaller ones cost more in scheduling than they gain) and at most `MAX_CHUNK`.
const MIN_CHUNK: usize = 1 << 20;
const MAX_CHUNK: usize = 8 << 20;
/// The smallest piece [`copy_host_pieces`] takes when asked for a piece size.
const MIN_PIECE: usize = 64 << 10;

/// Page-locks `len` bytes at `ptr` (`cuMemHostRegister`, portable to every context) until dropped;
/// registering and unregistering bind the primary context of the device it was made for.
///
/// The memory stays owned by the caller, who must keep it allocated until this value is dropped;
/// the Python binding holds a reference to the owning tensor inside the registration to enforce it.
#[derive(Debug)]
pub struct HostRegistration {
    ptr: usize,
    len: usize,
    ordinal: usize,
    /// Where a failure to unregister goes.
    errors: ErrorSlot,
}

impl HostRegistration {
    /// Registers the range in the primary context of device `ordinal`. Registering is about 6x
    /// faster than `cuMemHostAlloc` of the same size. A failure to unregister it when dropped is
    /// recorded in `errors`.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` is allocated host memory (not already registered) that stays allocated
    /// until the returned value is dropped.
    pub unsafe fn register(
        ordinal: usize,
        ptr: usize,
        len: usize,
        errors: &ErrorSlot,
    ) -> Result<Self> {
        let _ctx = bind_context(ordinal)?;
        if ptr == 0 || len == 0 {
            return Err(CudaError::InvalidArgument(format!(
                "cannot page-lock {len} bytes at address {ptr:#x}"
            )));
        }
        check_host_range("page-locking", ptr, len)?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: the caller guarantees [ptr, ptr+len) is allocated host memory that outlives `Self`.
        let code = unsafe { sys::cuMemHostRegister_v2(ptr as *mut std::ffi::c_void, len, flags) };
        check(
            code,
            "cuMemHostRegister",
            &format!("page-locking {len} bytes of host memory"),
        )?;
        Ok(Self {
            ptr,
            len,
            ordinal,
            errors: errors.clone(),
        })
    }

    pub fn ptr(&self) -> usize {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let context = format!("unregistering {} bytes of page-locked memory", self.len);
        let unregistered = bind_primary(self.ordinal).and_then(|_ctx| {
            // SAFETY: the range was registered by `register` and is unregistered exactly once
            // here, in the context it was registered in.
            let code = unsafe { sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void) };
            check(code, "cuMemHostUnregister", &context)
        });
        if let Err(e) = unregistered {
            self.errors.record(&context, e);
        }
    }
}

/// An owned, page-aligned host buffer (anonymous mapping), page-locked when `pinned`.
/// Used for the bounded staging ring; weights themselves live in memory owned by Python.
#[derive(Debug)]
pub struct HostBuffer {
    // Field order matters: the registration is dropped (unregistered) before the mapping is unmapped.
    registration: Option<HostRegistration>,
    map: memmap2::MmapMut,
}

impl HostBuffer {
    /// Maps `len` bytes, page-locked for device `pin_for` when given (a failure to unregister them
    /// later is recorded in `errors`).
    pub fn new(len: usize, pin_for: Option<usize>, errors: &ErrorSlot) -> Result<Self> {
        let map = memmap2::MmapMut::map_anon(len.max(1)).map_err(|e| {
            CudaError::OutOfMemory(format!("mapping a {len}-byte host buffer: {e}"))
        })?;
        let registration = match pin_for {
            // SAFETY: the mapping is owned by `Self`, whose field order drops (unregisters) the
            // registration before the mapping is unmapped.
            Some(ordinal) => Some(unsafe {
                HostRegistration::register(ordinal, map.as_ptr() as usize, map.len(), errors)
            }?),
            None => None,
        };
        Ok(Self { registration, map })
    }

    pub fn ptr(&self) -> usize {
        self.map.as_ptr() as usize
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn is_pinned(&self) -> bool {
        self.registration.is_some()
    }
}

/// Copies `n` bytes from host address `src` to host address `dst`, in parallel chunks on the
/// current rayon pool when large.
///
/// # Safety
/// `src` is `n` readable and `dst` `n` writable bytes of host memory, disjoint, allocated for the
/// duration of the call and not written by anyone else meanwhile.
pub unsafe fn copy_host(dst: usize, src: usize, n: usize) {
    // SAFETY: the caller upholds the same contract.
    unsafe { copy_host_pieces(dst, src, n, 0) }
}

/// [`copy_host`] in pieces of `piece` bytes (rounded down to 64, at least 64 KiB), which the pool's
/// threads take as they become free: pieces smaller than an even share let the other threads
/// finish the work of one that the scheduler parked (a busy Python thread on the same cores).
/// `piece == 0`: an even share per thread, 1-8 MiB.
///
/// # Safety
/// As [`copy_host`].
pub unsafe fn copy_host_pieces(dst: usize, src: usize, n: usize, piece: usize) {
    if n == 0 {
        return;
    }
    if n <= SERIAL_MAX {
        // SAFETY: the caller guarantees both ranges are live, `n` bytes long and disjoint.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, n) };
        return;
    }
    let chunk = match piece {
        0 => (n / rayon::current_num_threads().max(1)).clamp(MIN_CHUNK, MAX_CHUNK),
        p => p.max(MIN_PIECE),
    } & !63;
    let chunks = n.div_ceil(chunk);
    (0..chunks).into_par_iter().for_each(|i| {
        let off = i * chunk;
        let len = chunk.min(n - off);
        // SAFETY: each chunk is a disjoint sub-range of the caller's live, disjoint ranges.
        unsafe {
            std::ptr::copy_nonoverlapping((src + off) as *const u8, (dst + off) as *mut u8, len)
        };
    });
}

/// Checks a host range from a caller: `n` bytes at `addr` must not start at address 0 nor wrap
/// past the end of the address space.
pub fn check_host_range(what: &str, addr: usize, n: usize) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    if addr == 0 {
        return Err(CudaError::InvalidArgument(format!(
            "{what}: {n} bytes at address 0 (a null pointer); pass the address of memory that \
             holds them"
        )));
    }
    if addr
        .checked_add(n)
        .is_none_or(|end| end > isize::MAX as usize + 1)
    {
        return Err(CudaError::InvalidArgument(format!(
            "{what}: {n} bytes at address {addr:#x} run past the end of the address space"
        )));
    }
    Ok(())
}

/// Checks a `(dst, src, n)` host copy from a caller: both ranges valid ([`check_host_range`]) and
/// disjoint (the copy is a `memcpy`).
fn check_host_copy(dst: usize, src: usize, n: usize) -> Result<()> {
    check_host_range("copy destination", dst, n)?;
    check_host_range("copy source", src, n)?;
    if n > 0 && dst < src + n && src < dst + n {
        return Err(CudaError::InvalidArgument(format!(
            "copy of {n} bytes from {src:#x} to {dst:#x}: the ranges overlap"
        )));
    }
    Ok(())
}

/// Runs many `(dst, src, n)` host copies in parallel (one rayon task per copy, large copies split),
/// after checking every one (`check_host_copy`): none runs when one is invalid.
///
/// # Safety
/// For every job, `src` is `n` readable and `dst` `n` writable bytes of host memory, allocated for
/// the duration of the call and not written by anyone else meanwhile; no job's destination
/// overlaps another job's source or destination. (Null, wrapping and self-overlapping ranges are
/// refused: those are checked.)
pub unsafe fn copy_host_many(jobs: &[(usize, usize, usize)]) -> Result<()> {
    for &(dst, src, n) in jobs {
        check_host_copy(dst, src, n)?;
    }
    jobs.par_iter().for_each(|&(dst, src, n)| {
        // SAFETY: each range was checked above and the caller guarantees the memory behind it.
        unsafe { copy_host(dst, src, n) }
    });
    Ok(())
}

/// Reads byte ranges of one file straight into host memory: `(file_offset, len, dst)` jobs, in
/// parallel on the current rayon pool, with positional reads (`pread`), never through a memory map,
/// so the file's pages are not charged to the process (RSS stays at the destination's size).
///
/// Errors: [`CudaError::InvalidArgument`] for a job whose destination is null or wraps,
/// [`CudaError::Read`] (naming the file) for a range past the end of the file or a failed read.
///
/// # Safety
/// Every job's `dst` is `len` writable bytes of host memory, allocated for the duration of the
/// call, read or written by nobody else meanwhile, and disjoint from every other job's.
pub unsafe fn read_file_into(path: &std::path::Path, jobs: &[(u64, usize, usize)]) -> Result<()> {
    let file = std::fs::File::open(path)
        .map_err(|e| CudaError::Read(format!("opening {}: {e}", path.display())))?;
    // SAFETY: the caller upholds the same contract.
    unsafe { read_fd_into(&file, path, jobs) }
}

/// [`read_file_into`] from a file that is already open (a validated index's file: the bytes then
/// come from the file whose header was checked, even if another file was renamed over its path).
/// `path` names the file in messages.
///
/// # Safety
/// As for [`read_file_into`].
pub unsafe fn read_fd_into(
    file: &std::fs::File,
    path: &std::path::Path,
    jobs: &[(u64, usize, usize)],
) -> Result<()> {
    use std::os::unix::fs::FileExt;
    const PIECE: usize = 16 << 20;
    let shown = path.display();
    let size = file
        .metadata()
        .map_err(|e| CudaError::Read(format!("reading the size of {shown}: {e}")))?
        .len();
    let mut count = 0usize;
    for &(off, len, dst) in jobs {
        check_host_range(&format!("reading {shown}"), dst, len)?;
        if off.checked_add(len as u64).is_none_or(|end| end > size) {
            return Err(CudaError::Read(format!(
                "reading {shown}: bytes {off}..{} are asked for but the file is {size} bytes \
                 (truncated or replaced?)",
                off as u128 + len as u128
            )));
        }
        count += len.div_ceil(PIECE); // at most size / PIECE + 1 per job: bounded by the file
    }
    let mut pieces: Vec<(u64, usize, usize)> = Vec::new();
    pieces
        .try_reserve_exact(count)
        .map_err(|_| CudaError::OutOfMemory(format!("listing {count} reads of {shown}")))?;
    for &(off, len, dst) in jobs {
        for i in 0..len.div_ceil(PIECE) {
            let o = i * PIECE;
            pieces.push((off + o as u64, PIECE.min(len - o), dst + o));
        }
    }
    pieces
        .par_iter()
        .try_for_each(|&(off, len, dst)| {
            // SAFETY: the caller guarantees `dst` points to `len` writable bytes that stay allocated
            // and are not read or written by anyone else until this call returns (the range was
            // checked not to be null nor to wrap); pieces of one job are disjoint sub-ranges.
            let buf = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
            file.read_exact_at(buf, off)
        })
        .map_err(|e| CudaError::Read(format!("reading {shown}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_small_and_large_ranges_exactly() {
        for n in [
            0usize,
            1,
            255,
            SERIAL_MAX,
            SERIAL_MAX + 1,
            MAX_CHUNK * 3 + 17,
        ] {
            let src: Vec<u8> = (0..n).map(|i| (i * 31 % 251) as u8).collect();
            let mut dst = vec![0u8; n];
            // SAFETY: two live, disjoint vectors of `n` bytes.
            unsafe { copy_host(dst.as_mut_ptr() as usize, src.as_ptr() as usize, n) };
            assert_eq!(src, dst, "size {n}");
        }
    }

    #[test]
    fn copies_in_any_piece_size_exactly() {
        let n = SERIAL_MAX * 5 + 4099;
        let src: Vec<u8> = (0..n).map(|i| (i * 13 % 241) as u8).collect();
        for piece in [0usize, 1, 100, MIN_PIECE, MIN_PIECE + 1, 3 << 20, n, 2 * n] {
            let mut dst = vec![0u8; n];
            // SAFETY: two live, disjoint vectors of `n` bytes.
            unsafe { copy_host_pieces(dst.as_mut_ptr() as usize, src.as_ptr() as usize, n, piece) };
            assert_eq!(src, dst, "piece {piece}");
        }
    }

    #[test]
    fn copy_many_runs_every_job() {
        let a: Vec<u8> = vec![7; 1000];
        let b: Vec<u8> = vec![9; 3000];
        let mut out = vec![0u8; 4000];
        let base = out.as_mut_ptr() as usize;
        // SAFETY: two disjoint halves of `out`, from two live vectors of those sizes.
        unsafe {
            copy_host_many(&[
                (base, a.as_ptr() as usize, 1000),
                (base + 1000, b.as_ptr() as usize, 3000),
            ])
        }
        .unwrap();
        assert!(out[..1000].iter().all(|&x| x == 7));
        assert!(out[1000..].iter().all(|&x| x == 9));
    }

    #[test]
    fn reads_file_ranges_into_memory() {
        let dir = std::env::temp_dir().join(format!("ddo-read-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.bin");
        let data: Vec<u8> = (0..(40usize << 20)).map(|i| (i % 249) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let mut out = vec![0u8; 20 << 20];
        let base = out.as_mut_ptr() as usize;
        // SAFETY (every call below): the destinations are disjoint ranges inside `out`, which
        // outlives the calls, or are refused before anything is read.
        let read = |jobs: &[(u64, usize, usize)]| unsafe { read_file_into(&path, jobs) };
        read(&[(5, 1000, base), (1 << 20, (20 << 20) - 1000, base + 1000)]).unwrap();
        assert_eq!(&out[..1000], &data[5..1005]);
        assert_eq!(&out[1000..], &data[1 << 20..(1 << 20) + (20 << 20) - 1000]);
        let err = read(&[(data.len() as u64 - 10, 100, base)]).unwrap_err();
        assert!(matches!(err, CudaError::Read(_)), "{err}");
        assert!(err.to_string().contains("f.bin") && err.to_string().contains("file is"));
        // a range the size of the address space is refused before anything is listed or read
        let err = read(&[(0, 1 << 50, base)]).unwrap_err();
        assert!(matches!(err, CudaError::Read(_)), "{err}");
        let err = read(&[(0, 10, 0)]).unwrap_err();
        assert!(matches!(err, CudaError::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("null pointer"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_host_copies_are_refused_before_any_runs() {
        let mut out = [0u8; 8];
        let src = [1u8; 8];
        let (d, s) = (out.as_mut_ptr() as usize, src.as_ptr() as usize);
        for (jobs, want) in [
            (vec![(d, s, 8), (0, s, 8)], "null pointer"),
            (
                vec![(d, usize::MAX - 2, 8)],
                "past the end of the address space",
            ),
            (vec![(d, d + 2, 4)], "overlap"),
        ] {
            // SAFETY: refused before any copy runs.
            let err = unsafe { copy_host_many(&jobs) }.unwrap_err();
            assert!(matches!(err, CudaError::InvalidArgument(_)), "{err}");
            assert!(err.to_string().contains(want), "want {want:?} in {err}");
        }
        assert_eq!(out, [0; 8]);
        // SAFETY: `src` and `out` are 8 live, disjoint bytes; the empty job touches nothing.
        unsafe { copy_host_many(&[(d, s, 8), (0, 0, 0)]) }.unwrap();
        assert_eq!(out, [1; 8]);
    }

    #[test]
    fn unpinned_buffer_is_page_aligned_and_writable() {
        let buf = HostBuffer::new(10_000, None, &ErrorSlot::default()).unwrap();
        assert_eq!(buf.ptr() % 4096, 0);
        assert!(!buf.is_pinned());
        let src = [1u8; 16];
        // SAFETY: the buffer holds 10 000 writable bytes; `src` 16 readable ones.
        unsafe { copy_host(buf.ptr(), src.as_ptr() as usize, 16) };
    }
}
