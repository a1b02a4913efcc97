//! Property tests over untrusted bytes: arbitrary input and mutated valid frames (bit flips,
//! truncation, rewritten length, wrong magic/version/kind/flags) fed to `frame::decode_frame`,
//! `frame::read_frame` and tensor decoding.
//!
//! Every property checks "never a panic" (proptest reports one as a failure), that every `Ok`
//! respects the cap, and, through a counting global allocator, that no single allocation and no
//! peak of live memory on the decoding thread goes beyond what the input can justify.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use proptest::prelude::*;
use tokio::io::{AsyncRead, ReadBuf};
use troupe_transport::codec::{
    Compression, Encoding, TensorEncodeOptions, TensorLimits, WireDtype, WireTensor, decode_tensor,
    encode_tensor, smooth_activation,
};
use troupe_transport::frame::{FrameHeader, FrameKind, FrameLimits, HEADER_LEN, decode_frame, read_frame};

/// `frame::READ_CHUNK`: the reader grows its body buffer by at most this much per read.
const READ_CHUNK: usize = 1 << 20;
const CASES: u32 = 2_000;

// ---- a global allocator that measures the current thread while asked to ----

struct Counting;

thread_local! {
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn on_alloc(size: usize) {
    let _ = ACTIVE.try_with(|a| {
        if a.get() {
            LARGEST.with(|l| l.set(l.get().max(size)));
            LIVE.with(|l| {
                let v = l.get() + size as isize;
                l.set(v);
                PEAK.with(|p| p.set(p.get().max(v)));
            });
        }
    });
}

fn on_dealloc(size: usize) {
    let _ = ACTIVE.try_with(|a| {
        if a.get() {
            LIVE.with(|l| l.set(l.get() - size as isize));
        }
    });
}

// SAFETY: forwards to the system allocator unchanged; the bookkeeping only touches
// const-initialised thread-local cells (no allocation, no destructors).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        on_alloc(layout.size());
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        on_alloc(layout.size());
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        on_dealloc(layout.size());
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        on_dealloc(layout.size());
        on_alloc(new_size);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Memory used by `f` on this thread: (largest single allocation, peak live bytes).
fn measure<R>(f: impl FnOnce() -> R) -> (R, usize, usize) {
    LIVE.with(|l| l.set(0));
    PEAK.with(|p| p.set(0));
    LARGEST.with(|l| l.set(0));
    ACTIVE.with(|a| a.set(true));
    let r = f();
    ACTIVE.with(|a| a.set(false));
    let peak = PEAK.with(|p| p.get()).max(0) as usize;
    (r, LARGEST.with(|l| l.get()), peak)
}

// ---- an async reader over bytes that hands out small pieces and counts them ----

/// Serves `data` at most `step` bytes per read and counts what it handed out.
struct Trickle<'a> {
    data: &'a [u8],
    step: usize,
    supplied: usize,
}

impl AsyncRead for Trickle<'_> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let n = self.step.min(buf.remaining()).min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        buf.put_slice(head);
        self.data = rest;
        self.supplied += n;
        Poll::Ready(Ok(()))
    }
}

/// Drives a future whose reader is always ready (no runtime needed).
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    for _ in 0..1_000_000 {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
    panic!("a reader over in-memory bytes never finished");
}

// ---- inputs ----

fn kind_strategy() -> impl Strategy<Value = FrameKind> {
    (1u8..=8).prop_map(|k| FrameKind::from_u8(k).expect("kinds 1..=8 exist"))
}

/// A valid frame on the wire: header plus a body of arbitrary bytes.
fn valid_wire() -> impl Strategy<Value = Vec<u8>> {
    (kind_strategy(), prop::bool::ANY, prop::collection::vec(any::<u8>(), 0..600)).prop_map(
        |(kind, by_ref, body)| {
            let mut wire =
                FrameHeader { kind, flags: u16::from(by_ref), len: body.len() as u32 }.to_bytes().to_vec();
            wire.extend_from_slice(&body);
            wire
        },
    )
}

#[derive(Clone, Debug)]
enum Mutation {
    FlipBit(usize, u8),
    Truncate(usize),
    SetLength(u32),
    SetMagic(usize, u8),
    SetVersion(u8),
    SetKind(u8),
    SetFlags(u16),
    Append(Vec<u8>),
    Overwrite(usize, u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
        2 => any::<usize>().prop_map(Mutation::Truncate),
        2 => prop_oneof![any::<u32>(), 0u32..2048].prop_map(Mutation::SetLength),
        1 => (0usize..4, any::<u8>()).prop_map(|(i, v)| Mutation::SetMagic(i, v)),
        1 => any::<u8>().prop_map(Mutation::SetVersion),
        1 => any::<u8>().prop_map(Mutation::SetKind),
        1 => any::<u16>().prop_map(Mutation::SetFlags),
        1 => prop::collection::vec(any::<u8>(), 1..64).prop_map(Mutation::Append),
        3 => (any::<usize>(), any::<u64>()).prop_map(|(i, v)| Mutation::Overwrite(i, v)),
    ]
}

fn apply(wire: &mut Vec<u8>, m: &Mutation) {
    match m {
        Mutation::FlipBit(i, b) => {
            if !wire.is_empty() {
                let i = i % wire.len();
                wire[i] ^= 1 << b;
            }
        }
        Mutation::Truncate(n) => wire.truncate(n % (wire.len() + 1)),
        Mutation::SetLength(len) => {
            if wire.len() >= HEADER_LEN {
                wire[8..12].copy_from_slice(&len.to_le_bytes());
            }
        }
        Mutation::SetMagic(i, v) if wire.len() >= HEADER_LEN => wire[*i] = *v,
        Mutation::SetVersion(v) if wire.len() >= HEADER_LEN => wire[4] = *v,
        Mutation::SetKind(v) if wire.len() >= HEADER_LEN => wire[5] = *v,
        Mutation::SetFlags(f) if wire.len() >= HEADER_LEN => wire[6..8].copy_from_slice(&f.to_le_bytes()),
        Mutation::SetMagic(..) | Mutation::SetVersion(_) | Mutation::SetKind(_) | Mutation::SetFlags(_) => {}
        Mutation::Append(extra) => wire.extend_from_slice(extra),
        Mutation::Overwrite(i, v) => {
            // Eight bytes anywhere in the body: hits lengths, offsets and fields of rkyv roots.
            if wire.len() >= HEADER_LEN + 8 {
                let i = HEADER_LEN + i % (wire.len() - HEADER_LEN - 7);
                wire[i..i + 8].copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// Feeds `wire` to both frame decoders and checks caps and memory.
fn check_frame_decoders(wire: &[u8], limits: &FrameLimits, step: usize) {
    let (res, largest, peak) = measure(|| decode_frame(wire, limits));
    if let Ok((frame, used)) = &res {
        assert!(frame.body.len() <= limits.max_body as usize);
        assert_eq!(*used, HEADER_LEN + frame.body.len());
        assert!(*used <= wire.len());
        assert_eq!(&frame.body[..], &wire[HEADER_LEN..*used]);
    }
    // decode_frame copies only bytes it was given.
    assert!(largest <= wire.len(), "largest {largest} for {}", wire.len());
    assert!(peak <= wire.len(), "peak {peak} for {}", wire.len());

    let mut reader = Trickle { data: wire, step, supplied: 0 };
    let (res, largest, peak) = measure(|| block_on(read_frame(&mut reader, limits)));
    let supplied = reader.supplied;
    if let Ok(Some(frame)) = &res {
        assert!(frame.body.len() <= limits.max_body as usize);
        assert_eq!(&frame.body[..], &wire[HEADER_LEN..HEADER_LEN + frame.body.len()]);
    }
    // Never more than the bytes that arrived plus one read chunk (rounded up to a power of two
    // by the buffer's growth), whatever the header announced: the bound frame.rs documents.
    let bound = (supplied + READ_CHUNK).next_power_of_two();
    assert!(largest <= bound, "allocated {largest} with {supplied} supplied");
    assert!(peak <= bound, "held {peak} with {supplied} supplied");
}

fn limits_strategy() -> impl Strategy<Value = FrameLimits> {
    prop_oneof![Just(16u32), Just(300), Just(4096), Just(64 << 20), Just(u32::MAX)]
        .prop_map(|max_body| FrameLimits { max_body })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn arbitrary_bytes_never_panic_or_overallocate(
        bytes in prop::collection::vec(any::<u8>(), 0..2048),
        limits in limits_strategy(),
        step in 1usize..512,
    ) {
        check_frame_decoders(&bytes, &limits, step);
    }

    #[test]
    fn mutated_frames_never_panic_or_overallocate(
        mut wire in valid_wire(),
        mutations in prop::collection::vec(mutation(), 1..4),
        limits in limits_strategy(),
        step in prop_oneof![Just(usize::MAX), 1usize..64],
    ) {
        for m in &mutations {
            apply(&mut wire, m);
        }
        check_frame_decoders(&wire, &limits, step);
    }

    #[test]
    fn huge_announced_length_costs_only_what_arrives(
        len in 0u32..(64 << 20),
        supplied in 0usize..4096,
        step in prop_oneof![Just(usize::MAX), 1usize..4096],
    ) {
        let mut wire = FrameHeader { kind: FrameKind::Tensor, flags: 0, len }.to_bytes().to_vec();
        wire.resize(HEADER_LEN + supplied, 0xA5);
        let limits = FrameLimits { max_body: 64 << 20 };
        check_frame_decoders(&wire, &limits, step);
        // Unless the announced body fully arrived, it is an error, never a short frame.
        let mut r = &wire[..];
        let res = block_on(read_frame(&mut r, &limits));
        prop_assert_eq!(res.is_ok(), (len as usize) <= supplied);
    }
}

// ---- tensor decoding ----

const TENSOR_CAP: usize = 256 << 10;

/// A valid tensor frame body: a real encoded tensor, raw or compressed, f32 or bf16.
fn tensor_body() -> impl Strategy<Value = Vec<u8>> {
    (
        1usize..3000,
        prop_oneof![Just(Compression::Never), Just(Compression::Always)],
        prop::bool::ANY,
        prop::bool::ANY,
    )
        .prop_map(|(n, compress, lossy_bf16, smooth)| {
            let data: Vec<f32> =
                if smooth { smooth_activation(n) } else { (0..n).map(|i| (i % 7) as f32 - 3.0).collect() };
            let shape = if n % 2 == 0 { vec![2, n / 2] } else { vec![n] };
            let opts = TensorEncodeOptions { compress, lossy_bf16, ..Default::default() };
            let (frame, _) = encode_tensor(&shape, &data, &opts).expect("valid input encodes");
            frame.body.to_vec()
        })
}

fn check_tensor_decode(body: &[u8]) {
    let frame = troupe_transport::Frame::from_bytes(FrameKind::Tensor, 0, body);
    let limits = TensorLimits { max_decoded_bytes: TENSOR_CAP };
    let (res, largest, _peak) = measure(|| decode_tensor(&frame, &limits));
    if let Ok(t) = &res {
        assert!(t.data.len() * 4 <= TENSOR_CAP);
        assert_eq!(t.data.len(), t.shape.iter().product::<usize>());
    }
    // The decoded tensor and the decompression buffer are each within the cap; nothing is
    // sized from an unchecked field. (Small fixed overheads: zstd's context, error strings.)
    assert!(
        largest <= TENSOR_CAP.max(body.len()) + (256 << 10),
        "allocated {largest} decoding a {}-byte body",
        body.len()
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn arbitrary_tensor_bodies_never_panic(
        body in prop::collection::vec(any::<u8>(), 0..1024),
    ) {
        check_tensor_decode(&body);
    }

    #[test]
    fn mutated_tensor_frames_never_panic_or_exceed_the_cap(
        body in tensor_body(),
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        // Mutate the body as if it were behind a header, then strip the header again.
        let mut wire = vec![0u8; HEADER_LEN];
        wire.extend_from_slice(&body);
        for m in &mutations {
            apply(&mut wire, m);
        }
        let body = wire.get(HEADER_LEN..).unwrap_or(&[]);
        check_tensor_decode(body);
    }

    #[test]
    fn well_formed_but_lying_tensor_headers_are_refused(
        shape in prop::collection::vec(
            prop_oneof![0u64..70, any::<u64>(), Just(1u64 << 32)], 0..4),
        bf16 in prop::bool::ANY,
        raw_len_choice in prop_oneof![Just(None), any::<u64>().prop_map(Some)],
        compressed in prop::bool::ANY,
        payload_len in prop_oneof![0usize..300, Just(65_536)],
        fill in any::<u8>(),
    ) {
        // Valid rkyv, so the semantic checks (shape vs raw_len, cap, payload length, bounded
        // decompression) are what stands between these fields and an allocation.
        let dtype_on_wire = if bf16 { WireDtype::Bf16 } else { WireDtype::F32 };
        let consistent = shape
            .iter()
            .try_fold(dtype_on_wire.size() as u64, |acc, d| acc.checked_mul(*d));
        let raw_len = raw_len_choice.or(consistent).unwrap_or(0);
        let plain = vec![fill; payload_len];
        let (encoding, payload) = if compressed {
            (Encoding::ShuffleZstd { level: 1 }, zstd::bulk::compress(&plain, 1).unwrap())
        } else {
            (Encoding::Raw, plain)
        };
        let wire = WireTensor { dtype_on_wire, shape, raw_len, encoding, payload };
        let frame = troupe_transport::Frame::encode(FrameKind::Tensor, &wire).unwrap();
        check_tensor_decode(&frame.body);
        let res = decode_tensor(&frame, &TensorLimits { max_decoded_bytes: TENSOR_CAP });
        // Ok exactly when every field agrees and the size is within the cap.
        let should_pass = consistent == Some(raw_len)
            && u128::from(raw_len) / dtype_on_wire.size() as u128 * 4 <= TENSOR_CAP as u128
            && raw_len == payload_len as u64;
        prop_assert_eq!(res.is_ok(), should_pass, "{:?}", res.err());
    }

    #[test]
    fn valid_tensor_frames_round_trip(body in tensor_body()) {
        let frame = troupe_transport::Frame::from_bytes(FrameKind::Tensor, 0, &body);
        let t = decode_tensor(&frame, &TensorLimits::default());
        prop_assert!(t.is_ok(), "{:?}", t.err());
    }
}

// ---- per-message decoded-bytes budget ----

#[test]
fn a_message_of_compression_bombs_stops_at_its_budget_before_allocating() {
    use troupe_transport::codec::{CodecError, DecodeBudget, TensorDecoder};
    // One bomb: 4 MiB of zeros decoded from ~200 bytes on the wire, within the per-tensor cap.
    let opts = TensorEncodeOptions { compress: Compression::Always, ..Default::default() };
    let (bomb, report) = encode_tensor(&[1 << 20], &vec![0.0f32; 1 << 20], &opts).unwrap();
    assert!(report.wire_bytes < 1024, "{report:?}");
    let per_tensor = 4usize << 20;
    let budget_cap = 16u64 << 20;
    let mut decoder = TensorDecoder::new(TensorLimits { max_decoded_bytes: per_tensor });
    let mut budget = DecodeBudget::new(budget_cap);
    // A message of 64 such tensors (256 MiB decoded from ~13 KiB): decode until refused.
    let ((decoded, refused), _largest, peak) = measure(|| {
        let mut decoded = Vec::new();
        let mut refused = None;
        for i in 0..64 {
            match decoder.decode_frame(&bomb, &mut budget) {
                Ok(t) => decoded.push(t),
                Err(e) => {
                    refused = Some((i, e));
                    break;
                }
            }
        }
        (decoded, refused)
    });
    let (at, e) = refused.expect("the budget never refused a 256 MiB message");
    assert_eq!((at, decoded.len()), (4, 4), "16 MiB of budget holds four 4 MiB tensors");
    assert!(matches!(e, CodecError::OverBudget { cap, .. } if cap == budget_cap), "{e}");
    assert!(e.to_string().contains("budget of 16777216 bytes"), "{e}");
    // Live memory: the four outputs, the decompression scratch (one tensor) and zstd's context;
    // the refused fifth tensor allocated nothing.
    let bound = budget_cap as usize + per_tensor + (1 << 20);
    assert!(peak <= bound, "peak {peak} > {bound}");
}
