//! Human-readable byte quantities for error messages and logs.

/// Bytes in one KiB.
pub const KIB: u64 = 1 << 10;
/// Bytes in one MiB.
pub const MIB: u64 = 1 << 20;
/// Bytes in one GiB.
pub const GIB: u64 = 1 << 30;

/// Formats a byte count with binary units and two decimals.
///
/// ```
/// use ddo_core::fmt_bytes;
/// assert_eq!(fmt_bytes(512), "512 B");
/// assert_eq!(fmt_bytes(1536), "1.50 KiB");
/// assert_eq!(fmt_bytes(3 << 29), "1.50 GiB");
/// ```
pub fn fmt_bytes(bytes: u64) -> String {
    // Precision loss above 2^53 bytes is irrelevant for two decimals.
    let b = bytes as f64;
    if bytes >= GIB {
        format!("{:.2} GiB", b / GIB as f64)
    } else if bytes >= MIB {
        format!("{:.2} MiB", b / MIB as f64)
    } else if bytes >= KIB {
        format!("{:.2} KiB", b / KIB as f64)
    } else {
        format!("{bytes} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_each_unit() {
        assert_eq!(fmt_bytes(0), "0 B");
        assert_eq!(fmt_bytes(1023), "1023 B");
        assert_eq!(fmt_bytes(KIB), "1.00 KiB");
        assert_eq!(fmt_bytes(5 * MIB / 2), "2.50 MiB");
        assert_eq!(fmt_bytes(GIB), "1.00 GiB");
        assert_eq!(fmt_bytes(80 * GIB), "80.00 GiB");
        assert!(fmt_bytes(u64::MAX).ends_with("GiB"));
    }
}
