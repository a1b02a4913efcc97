//! The one way bytes from a peer or a file become a workload message: a length cap, a charge to
//! the message's decoded-bytes budget, an aligned copy where the bytes are not aligned already,
//! then rkyv's checked access.
//!
//! Every workload's wire module (coe, pipeline, coadapt), the service router's bodies and the
//! journals' records decode through [`decode`] (owned values) or [`access`] (a look at the
//! archive), so there is one decode path and one error type, [`DecodeError`].
//!
//! The budget is charged before any aligned copy is allocated. Plain rkyv values (vectors,
//! strings, numbers) decode to at most [`DECODED_PER_WIRE_BYTE`] bytes per archived byte (the
//! aligned copy plus a `String` header of 24 bytes where its archive is 8), so that is what a
//! decode charges; compressed tensors inside a message are charged again, at their decoded size,
//! by the transport's tensor decoder against the same budget.

use rkyv::api::high::{HighDeserializer, HighValidator};
use rkyv::bytecheck::CheckBytes;
use rkyv::rancor;
use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize};
pub use troupe_transport::codec::DecodeBudget;

/// Bytes charged to the decoded-bytes budget per wire byte (see the module doc).
pub const DECODED_PER_WIRE_BYTE: u64 = 5;
/// Largest message accepted from a peer (the service envelope's own cap).
pub const MAX_MESSAGE_BYTES: usize = troupe_transport::service::DEFAULT_MAX_MESSAGE;
/// Decoded-bytes budget of one plain message of the largest accepted size.
pub const MAX_PLAIN_DECODED_BYTES: u64 = DECODED_PER_WIRE_BYTE * MAX_MESSAGE_BYTES as u64;

/// Why bytes were refused; each variant names the message type.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// More bytes than the cap.
    #[error("{what}: {got} bytes exceed the cap of {cap}")]
    TooLarge {
        /// Message type.
        what: &'static str,
        /// Bytes received.
        got: usize,
        /// The cap.
        cap: usize,
    },
    /// Decoding would pass the message's decoded-bytes budget.
    #[error("{what}: {detail}")]
    OverBudget {
        /// Message type.
        what: &'static str,
        /// The budget's refusal (names the budget).
        detail: String,
    },
    /// rkyv's validator refused the bytes.
    #[error("invalid {what} ({len} bytes): {detail}")]
    Malformed {
        /// Message type.
        what: &'static str,
        /// Bytes received.
        len: usize,
        /// The validator's message.
        detail: String,
    },
    /// The archive is valid but a field makes no sense (said by the caller's check).
    #[error("{what}: {detail}")]
    Invalid {
        /// Message type.
        what: &'static str,
        /// What is wrong.
        detail: String,
    },
}

/// Alignment rkyv's checked access needs of the bytes it reads.
const ARCHIVE_ALIGN: usize = 16;

/// `bytes` ready for checked access: as they are when already aligned, else an aligned copy.
enum Aligned<'a> {
    Borrowed(&'a [u8]),
    Copied(AlignedVec<ARCHIVE_ALIGN>),
}

impl std::ops::Deref for Aligned<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Aligned::Borrowed(b) => b,
            Aligned::Copied(c) => c,
        }
    }
}

/// Caps `bytes` at `cap`, charges the budget (the same whether or not a copy is made) and
/// aligns them for checked access, copying only when they are not aligned already (a large
/// `Vec<u8>` from the allocator usually is: a pulled activation then decodes without a copy).
fn aligned<'a>(
    what: &'static str,
    bytes: &'a [u8],
    cap: usize,
    budget: &mut DecodeBudget,
) -> Result<Aligned<'a>, DecodeError> {
    if bytes.len() > cap {
        return Err(DecodeError::TooLarge { what, got: bytes.len(), cap });
    }
    budget
        .charge(bytes.len() as u128 * u128::from(DECODED_PER_WIRE_BYTE))
        .map_err(|e| DecodeError::OverBudget { what, detail: e.to_string() })?;
    if bytes.as_ptr().align_offset(ARCHIVE_ALIGN) == 0 {
        return Ok(Aligned::Borrowed(bytes));
    }
    let mut copy = AlignedVec::<ARCHIVE_ALIGN>::with_capacity(bytes.len());
    copy.extend_from_slice(bytes);
    Ok(Aligned::Copied(copy))
}

/// Decodes an owned `T` of type name `what` from untrusted `bytes` of at most `cap` bytes,
/// charged to `budget` (see the module doc).
pub fn decode<T>(
    what: &'static str,
    bytes: &[u8],
    cap: usize,
    budget: &mut DecodeBudget,
) -> Result<T, DecodeError>
where
    T: Archive,
    T::Archived: for<'a> CheckBytes<HighValidator<'a, rancor::Error>>
        + Deserialize<T, HighDeserializer<rancor::Error>>,
{
    let copy = aligned(what, bytes, cap, budget)?;
    rkyv::from_bytes::<T, rancor::Error>(&copy).map_err(|e| DecodeError::Malformed {
        what,
        len: bytes.len(),
        detail: e.to_string(),
    })
}

/// Checked access to the archive of a `T` in untrusted `bytes` (capped and charged like
/// [`decode`]), handed to `f`, which checks fields and builds what it needs; its refusal
/// becomes [`DecodeError::Invalid`].
pub fn access<T, R>(
    what: &'static str,
    bytes: &[u8],
    cap: usize,
    budget: &mut DecodeBudget,
    f: impl FnOnce(&T::Archived) -> Result<R, String>,
) -> Result<R, DecodeError>
where
    T: Archive,
    T::Archived: rkyv::Portable + for<'a> CheckBytes<HighValidator<'a, rancor::Error>>,
{
    let copy = aligned(what, bytes, cap, budget)?;
    let archived = rkyv::access::<T::Archived, rancor::Error>(&copy).map_err(|e| DecodeError::Malformed {
        what,
        len: bytes.len(),
        detail: e.to_string(),
    })?;
    f(archived).map_err(|detail| DecodeError::Invalid { what, detail })
}

/// A fresh budget for one plain message (no compressed tensors) of up to [`MAX_MESSAGE_BYTES`].
pub fn plain_budget() -> DecodeBudget {
    DecodeBudget::new(MAX_PLAIN_DECODED_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_and_each_refusal_is_named() {
        let bytes = rkyv::to_bytes::<rancor::Error>(&vec![String::from("a"), String::from("bb")]).unwrap();
        let back: Vec<String> = decode("names", &bytes, 1024, &mut plain_budget()).unwrap();
        assert_eq!(back, ["a", "bb"]);

        let e = decode::<Vec<String>>("names", &bytes, 4, &mut plain_budget()).unwrap_err();
        assert!(matches!(e, DecodeError::TooLarge { what: "names", .. }), "{e}");

        let mut small = DecodeBudget::new(bytes.len() as u64);
        let e = decode::<Vec<String>>("names", &bytes, 1024, &mut small).unwrap_err();
        assert!(matches!(e, DecodeError::OverBudget { .. }), "{e}");
        assert_eq!(small.used(), 0, "a refused decode charges nothing");

        let e = decode::<Vec<String>>("names", &[0xff; 7], 1024, &mut plain_budget()).unwrap_err();
        assert!(matches!(e, DecodeError::Malformed { what: "names", len: 7, .. }), "{e}");

        let e = access::<Vec<String>, ()>("names", &bytes, 1024, &mut plain_budget(), |a| {
            Err(format!("{} names", a.len()))
        })
        .unwrap_err();
        assert_eq!(e.to_string(), "names: 2 names");
    }

    #[test]
    fn a_budget_is_shared_across_the_decodes_of_one_message() {
        let bytes = rkyv::to_bytes::<rancor::Error>(&vec![7u32; 64]).unwrap();
        let per = bytes.len() as u64 * DECODED_PER_WIRE_BYTE;
        let mut budget = DecodeBudget::new(per * 2);
        for _ in 0..2 {
            let _: Vec<u32> = decode("ids", &bytes, 1 << 20, &mut budget).unwrap();
        }
        let e = decode::<Vec<u32>>("ids", &bytes, 1 << 20, &mut budget).unwrap_err();
        assert!(matches!(e, DecodeError::OverBudget { .. }), "{e}");
    }

    #[test]
    fn aligned_and_unaligned_bytes_decode_alike() {
        let bytes = rkyv::to_bytes::<rancor::Error>(&vec![String::from("a"), String::from("bb")]).unwrap();
        // The same archive at an aligned start and one byte past it.
        let mut padded = AlignedVec::<16>::with_capacity(bytes.len() + 1);
        padded.extend_from_slice(&[0]);
        padded.extend_from_slice(&bytes);
        let (at_start, shifted) = (&bytes[..], &padded[1..]);
        assert_eq!(at_start.as_ptr().align_offset(ARCHIVE_ALIGN), 0);
        assert_ne!(shifted.as_ptr().align_offset(ARCHIVE_ALIGN), 0);
        for b in [at_start, shifted] {
            let mut budget = plain_budget();
            let back: Vec<String> = decode("names", b, 1024, &mut budget).unwrap();
            assert_eq!(back, ["a", "bb"]);
            assert_eq!(budget.used(), b.len() as u64 * DECODED_PER_WIRE_BYTE, "charged alike");
        }
        assert!(matches!(aligned("names", shifted, 1024, &mut plain_budget()).unwrap(), Aligned::Copied(_)));
        assert!(matches!(
            aligned("names", at_start, 1024, &mut plain_budget()).unwrap(),
            Aligned::Borrowed(_)
        ));
    }
}
