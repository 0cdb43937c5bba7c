//! Safetensors dtype names and their element sizes.

/// Every dtype name this crate accepts, as spelled in safetensors headers.
pub const KNOWN_DTYPES: &[&str] = &[
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E8M0",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "I64",
    "U64",
    "F64",
];

/// Size of one element in **bits**, for every dtype including sub-byte ones
/// (`F4` is 4 bits, `F6_*` are 6 bits). `None` for unknown names.
pub fn dtype_bits(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" | "F8_E4M3FNUZ"
        | "F8_E5M2FNUZ" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

/// Size of one element in bytes.
///
/// `None` for unknown dtypes and for sub-byte dtypes (`F4`, `F6_*`), whose
/// elements do not have a whole-byte size; use [`dtype_bits`] for those.
pub fn dtype_size(dtype: &str) -> Option<usize> {
    dtype_bits(dtype)
        .filter(|bits| bits % 8 == 0)
        .map(|bits| bits / 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(dtype_size("BOOL"), Some(1));
        assert_eq!(dtype_size("F8_E4M3"), Some(1));
        assert_eq!(dtype_size("F8_E5M2"), Some(1));
        assert_eq!(dtype_size("F8_E8M0"), Some(1));
        assert_eq!(dtype_size("F8_E4M3FNUZ"), Some(1));
        assert_eq!(dtype_size("F8_E5M2FNUZ"), Some(1));
        assert_eq!(dtype_size("BF16"), Some(2));
        assert_eq!(dtype_size("F16"), Some(2));
        assert_eq!(dtype_size("U16"), Some(2));
        assert_eq!(dtype_size("F32"), Some(4));
        assert_eq!(dtype_size("U32"), Some(4));
        assert_eq!(dtype_size("I64"), Some(8));
        assert_eq!(dtype_size("F64"), Some(8));
        assert_eq!(dtype_size("F4"), None);
        assert_eq!(dtype_bits("F4"), Some(4));
        assert_eq!(dtype_bits("F6_E3M2"), Some(6));
        assert_eq!(dtype_size("bf16"), None);
        assert_eq!(dtype_size("Q4_K"), None);
        for d in KNOWN_DTYPES {
            assert!(dtype_bits(d).is_some(), "{d}");
        }
    }
}
