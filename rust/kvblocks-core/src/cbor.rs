//! The few canonical CBOR (RFC 8949) items vLLM's `sha256_cbor` block hash encodes.
//!
//! vLLM hashes `cbor2.dumps((parent, tuple(tokens), extra_keys), canonical=True)`; the
//! items involved are unsigned integers, byte and text strings, arrays and `null`. For
//! those, canonical means only that every length and integer takes its shortest head
//! (there are no maps, floats or indefinite lengths to order or normalise), so the
//! encoder below is exact for them and needs no general CBOR library.

const MAJOR_UINT: u8 = 0;
const MAJOR_BYTES: u8 = 2;
const MAJOR_TEXT: u8 = 3;
const MAJOR_ARRAY: u8 = 4;
/// `null` (major type 7, simple value 22).
pub const NULL: u8 = 0xf6;

/// Append the shortest head of major type `major` carrying argument `n`.
#[inline]
pub fn push_head(buf: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    if n < 24 {
        buf.push(m | n as u8);
    } else if n <= u8::MAX as u64 {
        buf.extend_from_slice(&[m | 24, n as u8]);
    } else if n <= u16::MAX as u64 {
        buf.push(m | 25);
        buf.extend_from_slice(&(n as u16).to_be_bytes());
    } else if n <= u32::MAX as u64 {
        buf.push(m | 26);
        buf.extend_from_slice(&(n as u32).to_be_bytes());
    } else {
        buf.push(m | 27);
        buf.extend_from_slice(&n.to_be_bytes());
    }
}

/// Append an unsigned integer.
#[inline]
pub fn push_uint(buf: &mut Vec<u8>, n: u64) {
    push_head(buf, MAJOR_UINT, n);
}

/// Append a byte string.
pub fn push_bytes(buf: &mut Vec<u8>, bytes: &[u8]) {
    push_head(buf, MAJOR_BYTES, bytes.len() as u64);
    buf.extend_from_slice(bytes);
}

/// Append a text string (Python `str`).
pub fn push_text(buf: &mut Vec<u8>, text: &str) {
    push_head(buf, MAJOR_TEXT, text.len() as u64);
    buf.extend_from_slice(text.as_bytes());
}

/// Append the head of an array (Python `list` or `tuple`) of `len` items.
#[inline]
pub fn push_array(buf: &mut Vec<u8>, len: usize) {
    push_head(buf, MAJOR_ARRAY, len as u64);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(buf: &[u8]) -> String {
        buf.iter().map(|b| format!("{b:02x}")).collect()
    }

    // Expected bytes are `cbor2.dumps(x, canonical=True).hex()` (cbor2 6.3.0).
    #[test]
    fn integers_take_the_shortest_head() {
        let cases: [(u64, &str); 11] = [
            (0, "00"),
            (23, "17"),
            (24, "1818"),
            (255, "18ff"),
            (256, "190100"),
            (65535, "19ffff"),
            (65536, "1a00010000"),
            (4294967295, "1affffffff"),
            (4294967296, "1b0000000100000000"),
            (u64::MAX, "1bffffffffffffffff"),
            (1000, "1903e8"),
        ];
        for (n, want) in cases {
            let mut buf = Vec::new();
            push_uint(&mut buf, n);
            assert_eq!(hex(&buf), want, "{n}");
        }
    }

    #[test]
    fn strings_arrays_and_null() {
        let mut buf = Vec::new();
        // ("lora", "chat-ü", "") and (b"", b"x"*24, None)
        push_array(&mut buf, 3);
        push_text(&mut buf, "lora");
        push_text(&mut buf, "chat-ü");
        push_text(&mut buf, "");
        assert_eq!(hex(&buf), "83646c6f726167636861742dc3bc60");
        buf.clear();
        push_array(&mut buf, 3);
        push_bytes(&mut buf, b"");
        push_bytes(&mut buf, &[b'x'; 24]);
        buf.push(NULL);
        assert_eq!(
            hex(&buf),
            "83405818787878787878787878787878787878787878787878787878f6"
        );
        buf.clear();
        push_array(&mut buf, 24);
        assert_eq!(hex(&buf), "9818");
        buf.clear();
        push_text(&mut buf, &"s".repeat(300));
        assert_eq!(hex(&buf[..3]), "79012c");
    }
}
