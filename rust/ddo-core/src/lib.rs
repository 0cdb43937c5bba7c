//! Pure logic for the `ddo-blocks` GPU weight-offload manager.
//!
//! `ddo-core` knows neither Python nor CUDA. It provides:
//!
//! - [`index`]: a validated index of safetensors files (their headers, read
//!   with positional reads, never mapped), and sharded-checkpoint index parsing;
//! - [`layout`]: byte layout of streamed units (256-byte aligned tensors)
//!   and their packing into device slabs;
//! - [`planner`] and [`mod@simulate`]: deciding which units stay resident and
//!   how many slots stream the rest under a VRAM budget, scored by a
//!   discrete-event model of a copy stream and a compute stream;
//! - [`codec`]: the lossless fixed-rate (12-bit) code for bf16 weights, the
//!   reference encoder and decoder; [`landing`]: how a coded unit's chunks
//!   are batched into the decode ring's landing buffers;
//! - [`cache`]: the NVMe route's RAM cache (which streamed units stay in
//!   host RAM, the rest re-read from disk every pass), and [`reads`]: the
//!   coalesced, aligned read plan of a unit streamed from files.
//!
//! Every fallible function returns [`Result`] with a [`CoreError`] whose
//! message names the file, tensor or number at fault; nothing panics on bad
//! input. There is no `unsafe` code.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod cache;
pub mod codec;
pub mod dtype;
pub mod error;
pub mod huffman;
pub mod index;
pub mod landing;
pub mod layout;
pub mod planner;
pub mod reads;
pub mod simulate;
pub mod tiered;
pub mod units;

pub use cache::{plan_ram_cache, RamCachePlan, RamCacheRequest};
pub use dtype::{dtype_bits, dtype_size, KNOWN_DTYPES};
pub use error::{CoreError, Result};
pub use index::{parse_header, read_shard_index, Header, SafetensorsIndex, TensorInfo};
pub use layout::{
    align_up, layout_slabs, layout_unit, SlabLayout, UnitLayout, UnitPlacement, ALIGN,
};
pub use planner::{minimum_budget, plan, plan_counted, MinimumBudget, Plan, PlanCost, PlanRequest};
pub use reads::{plan_reads, ChunkCopy, ReadChunk, ReadPiece};
pub use simulate::{check_sim_inputs, simulate, simulate_disk, SimResult, MAX_PASSES, MAX_SLOTS};
pub use units::fmt_bytes;
