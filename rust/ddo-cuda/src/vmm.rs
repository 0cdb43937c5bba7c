//! CUDA virtual memory management: address ranges reserved once, physical chunks mapped into them
//! and unmapped again, a capped pool of chunks reused rather than churned.
//!
//! One [`VmmArena`] per device holds every range it reserved and every chunk it created. A chunk is
//! `chunk_bytes` of device memory (`cuMemCreate`, a multiple of the allocation granularity: 32 MiB
//! by default, where 2 MiB pages cost about 14x more to map on an H200). Mapping a chunk into a
//! range takes one from the free list, or creates one while fewer than `max_chunks` exist; unmapping
//! puts it back on the free list, and [`VmmArena::trim`] gives free chunks back to the driver. So
//! the arena never holds more than `max_chunks * chunk_bytes` of device memory, and addresses in a
//! range stay the same whatever is mapped behind them.
//!
//! Mapping is safe (the memory is new to everyone); unmapping is an `unsafe fn`: the caller
//! guarantees that no queued or running work touches the chunk (the Python arena waits on the last
//! use event of the component that owns it, never a context-wide synchronise).

use std::collections::BTreeMap;

use cudarc::driver::sys;

use crate::deferred::ErrorSlot;
use crate::driver::{bind_context, bind_primary, check, device};
use crate::error::{CudaError, Result};

/// The allocation properties of a chunk on device `dev`: plain device memory, no export handle.
fn properties(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: the struct is plain data (integers and a null pointer); all-zero is a valid value and
    // the fields that matter are set below.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop
}

/// A reserved address range and what is mapped in it, chunk by chunk.
#[derive(Debug)]
struct Range {
    chunks: Vec<Option<sys::CUmemGenericAllocationHandle>>,
}

/// Counts of an arena, for reports and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmmStats {
    pub chunk_bytes: usize,
    /// Chunks that exist (mapped or free).
    pub created: usize,
    /// Chunks mapped into some range.
    pub mapped: usize,
    /// The most chunks that may exist.
    pub max_chunks: usize,
    /// Chunks created since the arena was made (how much the pool churned).
    pub creations: usize,
    /// Chunk mappings since the arena was made.
    pub maps: usize,
}

/// Reserved ranges and a capped pool of physical chunks on one device.
#[derive(Debug)]
pub struct VmmArena {
    ordinal: usize,
    dev: sys::CUdevice,
    chunk: usize,
    max_chunks: usize,
    created: usize,
    creations: usize,
    maps: usize,
    free: Vec<sys::CUmemGenericAllocationHandle>,
    ranges: BTreeMap<u64, Range>,
    errors: ErrorSlot,
}

// SAFETY: the arena holds driver handles and addresses only; the driver API is thread-safe and every
// method binds the primary context first. Python serialises calls through `&mut self`.
unsafe impl Send for VmmArena {}

impl VmmArena {
    /// An arena on device `ordinal` with chunks of at least `chunk_bytes` (rounded up to the
    /// device's allocation granularity) and at most `max_bytes` of device memory in them.
    ///
    /// Errors: CUDA absent, a device or driver without virtual memory management, a chunk size of 0.
    pub fn new(ordinal: usize, chunk_bytes: usize, max_bytes: usize) -> Result<Self> {
        let _ctx = bind_context(ordinal)?;
        let dev = device(ordinal)?;
        let mut supported: std::ffi::c_int = 0;
        // SAFETY: valid out-pointer and device handle.
        check(
            unsafe {
                sys::cuDeviceGetAttribute(
                    &mut supported,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
                    dev,
                )
            },
            "cuDeviceGetAttribute",
            "asking whether the device supports virtual memory management",
        )?;
        if supported == 0 {
            return Err(CudaError::NotAvailable(format!(
                "device {ordinal} or its driver does not support CUDA virtual memory management \
                 (cuMemCreate/cuMemMap), which route=\"vmm\" needs; use route=\"linear\""
            )));
        }
        if chunk_bytes == 0 {
            return Err(CudaError::InvalidArgument(
                "the arena's chunk size must be positive".into(),
            ));
        }
        let prop = properties(dev);
        let mut granularity = 0usize;
        // SAFETY: valid out-pointer and properties.
        check(
            unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut granularity,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            },
            "cuMemGetAllocationGranularity",
            "reading the allocation granularity",
        )?;
        let granularity = granularity.max(1);
        let chunk = chunk_bytes.div_ceil(granularity) * granularity;
        Ok(Self {
            ordinal,
            dev,
            chunk,
            max_chunks: max_bytes / chunk,
            created: 0,
            creations: 0,
            maps: 0,
            free: Vec::new(),
            ranges: BTreeMap::new(),
            errors: ErrorSlot::child_of(ErrorSlot::process()),
        })
    }

    /// Bytes per chunk.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk
    }

    /// Counts of chunks.
    pub fn stats(&self) -> VmmStats {
        VmmStats {
            chunk_bytes: self.chunk,
            created: self.created,
            mapped: self.created - self.free.len(),
            max_chunks: self.max_chunks,
            creations: self.creations,
            maps: self.maps,
        }
    }

    /// Sets the cap on chunks. Chunks beyond it that are free are released at once; mapped ones
    /// stay until unmapped (then [`VmmArena::trim`] releases them).
    pub fn set_max_bytes(&mut self, max_bytes: usize) -> Result<()> {
        self.max_chunks = max_bytes / self.chunk;
        self.trim(
            self.max_chunks
                .saturating_sub(self.created - self.free.len()),
        )
    }

    /// Reserves an address range of at least `nbytes` (whole chunks) with nothing mapped; returns its base.
    pub fn reserve(&mut self, nbytes: usize) -> Result<u64> {
        self.errors.check()?;
        let n = nbytes.div_ceil(self.chunk).max(1);
        let size = n
            .checked_mul(self.chunk)
            .ok_or_else(|| CudaError::InvalidArgument(format!("cannot reserve {nbytes} bytes")))?;
        let _ctx = bind_context(self.ordinal)?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; no fixed address requested.
        check(
            unsafe { sys::cuMemAddressReserve(&mut base, size, self.chunk, 0, 0) },
            "cuMemAddressReserve",
            "reserving device addresses",
        )?;
        self.ranges.insert(
            base,
            Range {
                chunks: vec![None; n],
            },
        );
        Ok(base)
    }

    fn range(&mut self, base: u64) -> Result<&mut Range> {
        self.ranges.get_mut(&base).ok_or_else(|| {
            CudaError::InvalidArgument(format!("{base:#x} is not a range of this arena"))
        })
    }

    fn check_chunks(&mut self, base: u64, first: usize, count: usize) -> Result<()> {
        let n = self.range(base)?.chunks.len();
        if first.checked_add(count).is_none_or(|end| end > n) {
            return Err(CudaError::InvalidArgument(format!(
                "chunks {first}..{} are outside the range of {n} chunks",
                first.saturating_add(count)
            )));
        }
        Ok(())
    }

    /// What every map and unmap starts with: a recorded error first, the chunks inside the range, the
    /// device's primary context bound for the call.
    fn begin(&mut self, base: u64, first: usize, count: usize) -> Result<crate::ContextGuard> {
        self.errors.check()?;
        self.check_chunks(base, first, count)?;
        bind_context(self.ordinal)
    }

    /// Whether each chunk of the range at `base` is mapped.
    pub fn mapped(&self, base: u64) -> Result<Vec<bool>> {
        let r = self.ranges.get(&base).ok_or_else(|| {
            CudaError::InvalidArgument(format!("{base:#x} is not a range of this arena"))
        })?;
        Ok(r.chunks.iter().map(Option::is_some).collect())
    }

    /// Maps chunks `first..first+count` of the range at `base` (those not mapped yet), readable and
    /// writable by the device; returns how many it mapped. Their contents are undefined.
    ///
    /// Errors: [`CudaError::OutOfMemory`] when the cap is reached (nothing more is mapped; chunks
    /// mapped by this call before the error stay mapped) or the driver has no memory.
    pub fn map(&mut self, base: u64, first: usize, count: usize) -> Result<usize> {
        let _ctx = self.begin(base, first, count)?;
        let chunk = self.chunk;
        let mut done = 0;
        for i in first..first + count {
            if self.range(base)?.chunks[i].is_some() {
                continue;
            }
            if self.created - self.free.len() >= self.max_chunks {
                return Err(self.cap_reached());
            }
            let handle = match self.free.pop() {
                Some(h) => h,
                None => self.create()?,
            };
            let addr = base + (i * chunk) as u64;
            // SAFETY: `addr..addr+chunk` lies in a range this arena reserved (checked above) and has
            // nothing mapped (its slot is `None`); `handle` is a live chunk of exactly `chunk` bytes.
            let mapped = check(
                unsafe { sys::cuMemMap(addr, chunk, 0, handle, 0) },
                "cuMemMap",
                "mapping a chunk into the arena",
            )
            .and_then(|_| self.set_access(addr));
            if let Err(e) = mapped {
                // SAFETY: the mapping (if it happened) was never handed out.
                let _ = unsafe { sys::cuMemUnmap(addr, chunk) };
                self.free.push(handle);
                return Err(e);
            }
            self.range(base)?.chunks[i] = Some(handle);
            self.maps += 1;
            done += 1;
        }
        Ok(done)
    }

    fn set_access(&self, addr: u64) -> Result<()> {
        // SAFETY: plain data; zero is valid and the fields that matter are set.
        let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = self.dev;
        desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: `addr..addr+chunk` is mapped (just now) and `desc` lives for the call.
        check(
            unsafe { sys::cuMemSetAccess(addr, self.chunk, &desc, 1) },
            "cuMemSetAccess",
            "making an arena chunk accessible",
        )
    }

    fn cap_reached(&self) -> CudaError {
        CudaError::OutOfMemory(format!(
            "the arena's cap of {} chunks of {} bytes is reached",
            self.max_chunks, self.chunk
        ))
    }

    /// Creates a chunk; only called when none is free and fewer than the cap are mapped, and the
    /// free ones beyond the cap are released (`unmap`, `set_max_bytes`), so at most the cap exist.
    fn create(&mut self) -> Result<sys::CUmemGenericAllocationHandle> {
        if self.created >= self.max_chunks {
            return Err(self.cap_reached());
        }
        let prop = properties(self.dev);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and properties; the size is a multiple of the granularity.
        check(
            unsafe { sys::cuMemCreate(&mut handle, self.chunk, &prop, 0) },
            "cuMemCreate",
            "creating a chunk of device memory for the arena",
        )?;
        self.created += 1;
        self.creations += 1;
        Ok(handle)
    }

    /// Unmaps chunks `first..first+count` of the range at `base` (those mapped) and keeps them on the
    /// free list; returns how many it unmapped.
    ///
    /// # Safety
    /// No work queued or running on any stream reads or writes those chunks' addresses, and none will
    /// until they are mapped again (a tensor over them is not used before).
    pub unsafe fn unmap(&mut self, base: u64, first: usize, count: usize) -> Result<usize> {
        let _ctx = self.begin(base, first, count)?;
        let chunk = self.chunk;
        let mut done = 0;
        for i in first..first + count {
            let Some(handle) = self.range(base)?.chunks[i] else {
                continue;
            };
            // SAFETY: the chunk is mapped at this address (its slot holds its handle); the caller
            // guarantees no work uses it.
            check(
                unsafe { sys::cuMemUnmap(base + (i * chunk) as u64, chunk) },
                "cuMemUnmap",
                "unmapping an arena chunk",
            )?;
            self.range(base)?.chunks[i] = None;
            self.free.push(handle);
            done += 1;
        }
        // chunks beyond a cap lowered while they were mapped go back to the driver now
        let mapped = self.created - self.free.len();
        self.trim(self.max_chunks.saturating_sub(mapped))?;
        Ok(done)
    }

    /// Releases free chunks to the driver until at most `keep` are free.
    pub fn trim(&mut self, keep: usize) -> Result<()> {
        if self.free.len() <= keep {
            return Ok(());
        }
        let _ctx = bind_context(self.ordinal)?;
        while let Some(&handle) = self.free.last() {
            if self.free.len() <= keep {
                break;
            }
            // SAFETY: a free chunk is mapped nowhere.
            check(
                unsafe { sys::cuMemRelease(handle) },
                "cuMemRelease",
                "releasing an arena chunk",
            )?;
            self.free.pop();
            self.created -= 1;
        }
        Ok(())
    }

    /// Unmaps everything in the range at `base` and gives its addresses back.
    ///
    /// # Safety
    /// As for [`VmmArena::unmap`], for the whole range; no tensor over it is used again.
    pub unsafe fn free_range(&mut self, base: u64) -> Result<()> {
        let n = self.range(base)?.chunks.len();
        // SAFETY: the caller's guarantee, for every chunk of the range.
        unsafe { self.unmap(base, 0, n)? };
        let _ctx = bind_context(self.ordinal)?;
        self.ranges.remove(&base);
        // SAFETY: nothing is mapped in the range any more; it was reserved with this size.
        check(
            unsafe { sys::cuMemAddressFree(base, n * self.chunk) },
            "cuMemAddressFree",
            "freeing reserved device addresses",
        )
    }
}

impl Drop for VmmArena {
    /// Unmaps and releases everything. The Python owner synchronises the streams that used the arena
    /// before it lets go; failures are recorded in the process slot (the next context bind returns them).
    fn drop(&mut self) {
        let Ok(_ctx) = bind_primary(self.ordinal) else {
            return;
        };
        let during = "releasing the VMM arena";
        let chunk = self.chunk;
        for (base, range) in std::mem::take(&mut self.ranges) {
            for (i, handle) in range.chunks.iter().enumerate() {
                if let Some(h) = *handle {
                    // SAFETY: mapped here (the slot holds it); the owner guarantees no work uses it.
                    let code = unsafe { sys::cuMemUnmap(base + (i * chunk) as u64, chunk) };
                    if let Err(e) = check(code, "cuMemUnmap", during) {
                        self.errors.record(during, e);
                    }
                    self.free.push(h);
                }
            }
            // SAFETY: nothing is mapped in it any more.
            let code = unsafe { sys::cuMemAddressFree(base, range.chunks.len() * chunk) };
            if let Err(e) = check(code, "cuMemAddressFree", during) {
                self.errors.record(during, e);
            }
        }
        for h in std::mem::take(&mut self.free) {
            // SAFETY: mapped nowhere now.
            if let Err(e) = check(unsafe { sys::cuMemRelease(h) }, "cuMemRelease", during) {
                self.errors.record(during, e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver the arena is a clear `NotAvailable`; with one (the GPU machine), chunks map
    /// and unmap within the cap, addresses stay, and the cap is an `OutOfMemory` error.
    #[test]
    fn an_arena_maps_within_its_cap_or_says_cuda_is_missing() {
        let mb = 1usize << 20;
        let mut arena = match VmmArena::new(0, 2 * mb, 6 * mb) {
            Ok(a) => a,
            Err(e) => {
                assert!(matches!(e, CudaError::NotAvailable(_)), "{e}");
                return;
            }
        };
        let chunk = arena.chunk_bytes();
        arena.set_max_bytes(3 * chunk).unwrap();
        let base = arena.reserve(5 * chunk).unwrap();
        assert_eq!(arena.map(base, 0, 3).unwrap(), 3);
        assert_eq!(
            arena.map(base, 0, 3).unwrap(),
            0,
            "mapping what is mapped does nothing"
        );
        let err = arena.map(base, 3, 1).unwrap_err();
        assert!(matches!(err, CudaError::OutOfMemory(_)), "{err}");
        // SAFETY: nothing ever used the arena's memory.
        assert_eq!(unsafe { arena.unmap(base, 1, 2) }.unwrap(), 2);
        assert_eq!(
            arena.mapped(base).unwrap(),
            vec![true, false, false, false, false]
        );
        assert_eq!(
            arena.map(base, 3, 2).unwrap(),
            2,
            "the freed chunks are reused"
        );
        let s = arena.stats();
        assert_eq!((s.created, s.mapped, s.creations), (3, 3, 3));
        assert!(arena.map(base, 4, 2).is_err(), "outside the range");
        arena.trim(0).unwrap();
        // SAFETY: as above.
        unsafe { arena.free_range(base) }.unwrap();
        assert_eq!(arena.stats().mapped, 0);
    }
}
