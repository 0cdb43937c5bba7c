//! The crate-wide error type.

use crate::units::fmt_bytes;

/// Everything that can go wrong in `ddo-core`.
///
/// Messages are meant to be shown to users as-is: they name the file, the
/// tensor and what was expected versus what was found.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// A safetensors file is malformed.
    #[error("invalid safetensors file {path}: {reason}")]
    Checkpoint {
        /// The file, as given by the caller.
        path: String,
        /// What is wrong, naming the tensor where relevant.
        reason: String,
    },

    /// A sharded-checkpoint index (`*.safetensors.index.json`) is malformed.
    #[error("invalid sharded checkpoint index {path}: {reason}")]
    ShardIndex {
        /// The index file, as given by the caller.
        path: String,
        /// What is wrong.
        reason: String,
    },

    /// An operating-system error while reading a file.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file, as given by the caller.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// The VRAM budget cannot hold even the cheapest valid plan.
    ///
    /// The cheapest plan keeps `base` bytes resident and streams the other
    /// units through `(minimum - base) / largest_unit` slots of
    /// `largest_unit` bytes each. When `largest_unit` is 0 the cheapest plan
    /// keeps everything resident and `base == minimum`.
    #[error("{}", budget_message(*budget, *minimum, *largest_unit, *base))]
    BudgetTooSmall {
        /// The budget that was asked for, in bytes.
        budget: u64,
        /// The smallest budget that yields a valid plan, in bytes.
        minimum: u64,
        /// The slot size (largest streamed unit) of the cheapest plan.
        largest_unit: u64,
        /// Bytes resident in the cheapest plan: always-resident weights plus
        /// any units that are cheaper to keep than to stream.
        base: u64,
    },

    /// The planner was asked something meaningless (no units, NaN bandwidth, ...).
    #[error("invalid plan request: {0}")]
    InvalidPlanRequest(String),

    /// A caller passed a value no function can use (a NaN or negative float, a count or size
    /// beyond what fits in memory, a buffer of the wrong size).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// A `Result` whose error is [`CoreError`].
pub type Result<T> = std::result::Result<T, CoreError>;

fn budget_message(budget: u64, minimum: u64, largest_unit: u64, base: u64) -> String {
    let slots = minimum.saturating_sub(base).checked_div(largest_unit);
    let why = match slots {
        Some(slots) => format!(
            "always-resident {} + {slots} slots x {} largest unit",
            fmt_bytes(base),
            fmt_bytes(largest_unit)
        ),
        None => format!("all weights resident, {}", fmt_bytes(base)),
    };
    format!(
        "VRAM budget {} is below the minimum {} ({why}); pass vram_budget of at least {} ({minimum} bytes)",
        fmt_bytes(budget),
        fmt_bytes(minimum),
        fmt_bytes(minimum),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::{GIB, MIB};

    #[test]
    fn budget_message_explains_the_minimum() {
        let e = CoreError::BudgetTooSmall {
            budget: GIB,
            minimum: 3 * GIB / 2,
            largest_unit: GIB / 2,
            base: GIB / 2,
        };
        assert_eq!(
            e.to_string(),
            "VRAM budget 1.00 GiB is below the minimum 1.50 GiB (always-resident 512.00 MiB + \
             2 slots x 512.00 MiB largest unit); pass vram_budget of at least 1.50 GiB \
             (1610612736 bytes)"
        );
    }

    #[test]
    fn budget_message_all_resident() {
        let e = CoreError::BudgetTooSmall {
            budget: MIB,
            minimum: 3 * MIB,
            largest_unit: 0,
            base: 3 * MIB,
        };
        let s = e.to_string();
        assert!(s.contains("all weights resident, 3.00 MiB"), "{s}");
        assert!(s.contains("at least 3.00 MiB"), "{s}");
    }

    #[test]
    fn checkpoint_display() {
        let e = CoreError::Checkpoint {
            path: "a.safetensors".into(),
            reason: "boom".into(),
        };
        assert_eq!(
            e.to_string(),
            "invalid safetensors file a.safetensors: boom"
        );
    }
}
