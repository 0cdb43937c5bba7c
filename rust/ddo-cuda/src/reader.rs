//! Positional reads of weight files for the NVMe route: a file opened twice (buffered, and with
//! `O_DIRECT` where the filesystem allows it), chunk reads split into pieces read in parallel on a
//! reader pool, and a short bandwidth probe.
//!
//! `O_DIRECT` needs the file offset, the length and the buffer address aligned to the device's
//! logical block size; every read here uses [`ALIGN`] (4096) for all three (read plans widen ranges
//! to it, staging buffers are page-aligned), so the page cache is bypassed and host memory stays at
//! the staging ring plus the RAM cache. Where `O_DIRECT` is refused (tmpfs, some network and FUSE
//! filesystems: `EINVAL` at open or read) the same ranges are read with buffered `pread` and the
//! pages are dropped from the cache afterwards (`POSIX_FADV_DONTNEED`, best effort).

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use rayon::prelude::*;

use crate::error::{CudaError, Result};
use crate::host::HostBuffer;

/// Alignment of offsets, lengths and buffers of direct reads.
pub const ALIGN: usize = 4096;
/// Size of the pieces a chunk is split into, read in parallel (queue depth for NVMe).
pub const PIECE: usize = 4 << 20;

/// One weight file, open for positional reads.
#[derive(Debug)]
pub struct ReadFile {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    /// Cleared when a direct read is refused; later reads go buffered.
    direct_ok: AtomicBool,
}

impl ReadFile {
    /// Opens `path` buffered and, unless `allow_direct` is false or the filesystem refuses,
    /// with `O_DIRECT`.
    pub fn open(path: &Path, allow_direct: bool) -> Result<Self> {
        let buffered = File::open(path).map_err(|e| read_err(path, "opening", e))?;
        let direct = if allow_direct {
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
                .ok()
        } else {
            None
        };
        // The two opens name the path twice: a file renamed over it in between would give two
        // descriptors of different files, and reads would mix their bytes.
        if let Some(d) = &direct {
            same_file(path, &buffered, d)?;
        }
        let direct_ok = AtomicBool::new(direct.is_some());
        Ok(Self {
            path: path.to_path_buf(),
            buffered,
            direct,
            direct_ok,
        })
    }

    /// Whether reads currently bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct_ok.load(Ordering::Relaxed)
    }

    /// Reads `len` bytes at `offset` into host address `dst`, in pieces on the current rayon pool.
    /// The first `needed` bytes must exist in the file; the rest may lie past its end (alignment
    /// padding). Direct reads need `offset`, `len` and `dst` aligned to [`ALIGN`]; unaligned
    /// requests are read buffered.
    ///
    /// # Safety
    /// `dst` points to `len` writable bytes of host memory that stay allocated, and that nobody
    /// else reads or writes, until this returns.
    pub unsafe fn read_chunk(
        &self,
        offset: u64,
        len: usize,
        needed: usize,
        dst: usize,
    ) -> Result<()> {
        let aligned = chunk_is_aligned(offset, len, dst);
        (0..len.div_ceil(PIECE)).into_par_iter().try_for_each(|i| {
            let o = i * PIECE;
            let n = PIECE.min(len - o);
            let want = needed.saturating_sub(o).min(n);
            // SAFETY: each piece is a disjoint sub-range of the caller's `dst`.
            unsafe { self.read_span(aligned, offset + o as u64, n, want, dst + o) }
        })
    }

    /// Reads one piece of a chunk: `n` bytes at `offset` into `dst`, of which the first `want` must
    /// exist. `O_DIRECT` when the chunk is `aligned` and the file allows it; a filesystem that
    /// refuses it (`EINVAL`) turns it off for the file and the piece is read through the page
    /// cache, whose pages are then dropped.
    ///
    /// # Safety
    /// As for [`ReadFile::read_chunk`], with `n` bytes at `dst`.
    pub unsafe fn read_span(
        &self,
        aligned: bool,
        offset: u64,
        n: usize,
        want: usize,
        dst: usize,
    ) -> Result<()> {
        if aligned && self.is_direct() {
            // SAFETY: the caller's contract is `read_piece`'s.
            match unsafe { self.read_piece(true, offset, n, want, dst) } {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    // not an error: reads of this file go through the page cache from now on,
                    // which `is_direct` (the report's `direct` flag) tells
                    self.direct_ok.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(read_err(&self.path, "reading", e)),
            }
        }
        // SAFETY: as above.
        unsafe { self.read_piece(false, offset, n, want, dst) }
            .map_err(|e| read_err(&self.path, "reading", e))?;
        self.drop_cached(offset, n);
        Ok(())
    }

    /// # Safety
    /// As for [`ReadFile::read_span`].
    unsafe fn read_piece(
        &self,
        direct: bool,
        offset: u64,
        n: usize,
        want: usize,
        dst: usize,
    ) -> std::io::Result<()> {
        let file = match (direct, &self.direct) {
            (true, Some(f)) => f,
            _ => &self.buffered,
        };
        // SAFETY: the caller guarantees [dst, dst + n) is writable and owned by this read until it
        // returns.
        let buf = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, n) };
        let mut got = 0usize;
        while got < n {
            match file.read_at(&mut buf[got..], offset + got as u64) {
                Ok(0) => break,
                Ok(k) => got += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            if direct && got & (ALIGN - 1) != 0 {
                break; // a short direct read ends at end of file
            }
        }
        if got < want {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "the file ends at byte {} but the weights need bytes up to {} (truncated or \
                     replaced while offloaded?)",
                    offset + got as u64,
                    offset + want as u64
                ),
            ));
        }
        Ok(())
    }

    fn drop_cached(&self, offset: u64, len: usize) {
        // SAFETY: posix_fadvise only reads its arguments; the descriptor is open for `self`'s life.
        unsafe {
            libc::posix_fadvise(
                self.buffered.as_raw_fd(),
                offset as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            );
        }
    }
}

/// Checks that two descriptors opened from `path` name one file (same device and inode).
fn same_file(path: &Path, a: &File, b: &File) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let id = |f: &File| {
        f.metadata()
            .map(|m| (m.dev(), m.ino()))
            .map_err(|e| read_err(path, "reading the status of", e))
    };
    let (a, b) = (id(a)?, id(b)?);
    if a != b {
        return Err(CudaError::Read(format!(
            "{} was replaced while it was being opened (inode {} then inode {}); open it again once \
             it is no longer being written",
            path.display(),
            a.1,
            b.1
        )));
    }
    Ok(())
}

/// Whether a chunk's offset, length and destination all sit on [`ALIGN`] (the `O_DIRECT` rule).
pub fn chunk_is_aligned(offset: u64, len: usize, dst: usize) -> bool {
    (offset as usize | len | dst) & (ALIGN - 1) == 0
}

fn read_err(path: &Path, what: &str, e: std::io::Error) -> CudaError {
    CudaError::Read(format!("{what} {}: {e}", path.display()))
}

/// Result of [`measure_read_bandwidth`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiskProbe {
    pub bytes_per_s: f64,
    pub bytes: u64,
    /// Whether the probe bypassed the page cache (`O_DIRECT`).
    pub direct: bool,
}

/// Largest buffer a probe allocates: longer probes (a whole shard of several GiB) read through it
/// window by window, so measuring a model larger than RAM does not need its size in memory.
const PROBE_WINDOW: usize = 1 << 30;

/// Reads up to `max_bytes` from the start of `path` with the reader of the NVMe route (`threads`
/// readers, `PIECE`-sized pieces, `O_DIRECT` where possible) and returns the bandwidth. Buffered
/// reads (no `O_DIRECT`) may be served by the page cache and then overstate the disk.
pub fn measure_read_bandwidth(path: &Path, max_bytes: u64, threads: usize) -> Result<DiskProbe> {
    measure_in_windows(path, max_bytes, threads, PROBE_WINDOW)
}

fn measure_in_windows(
    path: &Path,
    max_bytes: u64,
    threads: usize,
    window: usize,
) -> Result<DiskProbe> {
    if threads > crate::job::MAX_THREADS {
        return Err(CudaError::InvalidArgument(format!(
            "a disk probe uses at most {} reader threads, got {threads}",
            crate::job::MAX_THREADS
        )));
    }
    let file = ReadFile::open(path, true)?;
    let file_len = std::fs::metadata(path)
        .map_err(|e| read_err(path, "reading the size of", e))?
        .len();
    let needed = file_len.min(max_bytes) as usize;
    if needed == 0 {
        return Err(CudaError::Read(format!(
            "{} is empty: nothing to measure",
            path.display()
        )));
    }
    let len = needed.div_ceil(ALIGN) * ALIGN;
    let window = window.div_ceil(ALIGN) * ALIGN;
    let buf = HostBuffer::new(len.min(window), None, &crate::ErrorSlot::default())?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .map_err(|e| CudaError::Staging(format!("cannot start reader threads: {e}")))?;
    let t0 = Instant::now();
    let mut offset = 0;
    while offset < len {
        let n = window.min(len - offset);
        let want = needed.saturating_sub(offset).min(n);
        // SAFETY: the buffer is owned here, holds at least `n` bytes and is not used elsewhere.
        pool.install(|| unsafe { file.read_chunk(offset as u64, n, want, buf.ptr()) })?;
        offset += n;
    }
    let secs = t0.elapsed().as_secs_f64().max(1e-9);
    Ok(DiskProbe {
        bytes_per_s: needed as f64 / secs,
        bytes: needed as u64,
        direct: file.is_direct(),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A scratch file of `len` patterned bytes in its own folder (the caller removes the folder).
    pub(crate) fn temp_file(name: &str, len: usize) -> (PathBuf, Vec<u8>) {
        // where /tmp is tmpfs (no O_DIRECT) the direct test exercises the fallback instead
        let dir = std::env::temp_dir().join(format!("ddo-reader-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.bin");
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        (path, data)
    }

    fn read_all(direct: bool) {
        let len = 3 * PIECE + 5000;
        let (path, data) = temp_file(if direct { "d" } else { "b" }, len);
        let f = ReadFile::open(&path, direct).unwrap();
        let padded = len.div_ceil(ALIGN) * ALIGN;
        let buf = HostBuffer::new(padded, None, &crate::ErrorSlot::default()).unwrap();
        // SAFETY (the three reads): each destination holds the bytes read and outlives the call.
        unsafe { f.read_chunk(0, padded, len, buf.ptr()) }.unwrap();
        // SAFETY: the buffer holds `padded` >= `len` initialised bytes (an anonymous mapping).
        let got = unsafe { std::slice::from_raw_parts(buf.ptr() as *const u8, len) };
        assert_eq!(got, &data[..]);
        // needing bytes past the end is an error naming the file
        let err = unsafe { f.read_chunk(0, padded, len + 1, buf.ptr()) }.unwrap_err();
        assert!(matches!(err, CudaError::Read(_)), "{err}");
        assert!(err.to_string().contains("w.bin"), "{err}");
        // unaligned ranges go buffered
        let mut small = vec![0u8; 100];
        unsafe { f.read_chunk(17, 100, 100, small.as_mut_ptr() as usize) }.unwrap();
        assert_eq!(&small[..], &data[17..117]);
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn buffered_reads_are_exact() {
        read_all(false);
    }

    #[test]
    fn direct_reads_are_exact_where_allowed() {
        read_all(true);
    }

    #[test]
    fn descriptors_of_two_files_are_refused() {
        let (a, _) = temp_file("same-a", 10);
        let (b, _) = temp_file("same-b", 10);
        let fa = File::open(&a).unwrap();
        same_file(&a, &fa, &File::open(&a).unwrap()).unwrap();
        let err = same_file(&a, &fa, &File::open(&b).unwrap()).unwrap_err();
        assert!(matches!(err, CudaError::Read(_)), "{err}");
        assert!(
            err.to_string()
                .contains("was replaced while it was being opened"),
            "{err}"
        );
        for p in [a, b] {
            std::fs::remove_dir_all(p.parent().unwrap()).unwrap();
        }
    }

    #[test]
    fn probe_measures_something() {
        let (path, _) = temp_file("probe", 1 << 20);
        let p = measure_read_bandwidth(&path, 64 << 20, 2).unwrap();
        assert_eq!(p.bytes, 1 << 20);
        assert!(p.bytes_per_s > 0.0);
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn probe_reads_a_long_range_through_a_smaller_window() {
        // 1 MiB + 123 bytes through a 256 KiB window: five windows, the last one partial and past EOF
        let (path, _) = temp_file("probe-window", (1 << 20) + 123);
        let p = measure_in_windows(&path, u64::MAX, 3, 256 << 10).unwrap();
        assert_eq!(p.bytes, (1 << 20) + 123);
        let capped = measure_in_windows(&path, 300 << 10, 3, 256 << 10).unwrap();
        assert_eq!(capped.bytes, 300 << 10);
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }
}
