//! Reading files with the page cache bypassed (`O_DIRECT`), so a load costs what a cold load costs.
//!
//! Reads go into a 4 KiB-aligned buffer in 4 MiB blocks at aligned offsets; an unaligned start or
//! tail is covered by reading whole blocks and exposing only the requested range. When the
//! filesystem refuses `O_DIRECT` (`EINVAL` on open or on the first read) the read falls back to a
//! buffered read followed by `posix_fadvise(DONTNEED)` and says so in [`ReadMode`].

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fs::{File, OpenOptions};
use std::io;
use std::ops::Deref;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;

use crate::error::{KernelError, Result};

/// Alignment of buffers, offsets and lengths for `O_DIRECT`.
pub const DIRECT_ALIGN: usize = 4096;
/// Bytes per read call.
pub const DIRECT_BLOCK: usize = 4 << 20;

/// A zeroed heap buffer aligned to [`DIRECT_ALIGN`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// Bytes allocated (and initialised): `len` rounded up to [`DIRECT_ALIGN`].
    cap: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access is read-only through Deref.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` zero bytes (a zero-length buffer still allocates one aligned block).
    pub fn zeroed(len: usize) -> Result<Self> {
        let cap = len
            .max(1)
            .checked_next_multiple_of(DIRECT_ALIGN)
            .ok_or_else(|| KernelError::invalid("AlignedBuf", format!("{len} bytes overflow usize")))?;
        let layout = Layout::from_size_align(cap, DIRECT_ALIGN)
            .map_err(|e| KernelError::invalid("AlignedBuf", e.to_string()))?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)
            .ok_or_else(|| KernelError::invalid("AlignedBuf", format!("allocation of {len} bytes failed")))?;
        Ok(Self { ptr, len, cap })
    }

    /// Bytes allocated: the most [`Self::set_len`] accepts.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Reuse the allocation for `len` bytes (what earlier uses left in them stays until
    /// overwritten). False, changing nothing, when `len` is over the capacity.
    pub fn set_len(&mut self, len: usize) -> bool {
        if len > self.cap {
            return false;
        }
        self.len = len;
        true
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes and uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: same layout as in `zeroed`.
        unsafe { dealloc(self.ptr.as_ptr(), Layout::from_size_align_unchecked(self.cap, DIRECT_ALIGN)) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

/// Bytes read from a file: a window into an aligned buffer (no copy for the unaligned edges).
#[derive(Debug)]
pub struct ReadBytes {
    buf: AlignedBuf,
    start: usize,
    len: usize,
}

impl Deref for ReadBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl ReadBytes {
    /// All of `buf` as the bytes.
    pub fn from_buf(buf: AlignedBuf) -> Self {
        let len = buf.len();
        Self { buf, start: 0, len }
    }

    /// The buffer behind the bytes, for reuse.
    pub fn into_buf(self) -> AlignedBuf {
        self.buf
    }
}

/// How a read was served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadMode {
    /// `O_DIRECT`: the page cache was bypassed.
    Direct,
    /// The filesystem refused `O_DIRECT`; a buffered read then `POSIX_FADV_DONTNEED`.
    BufferedFallback,
}

fn is_einval(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

/// Open `path` read-only with `O_DIRECT`.
pub(crate) fn open_direct(path: &Path) -> io::Result<File> {
    OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path)
}

/// Read `len` bytes at `offset` of `path`, bypassing the page cache where the filesystem allows.
pub fn read_range(path: &Path, offset: u64, len: usize) -> Result<(ReadBytes, ReadMode)> {
    read_range_with(path, offset, len, open_direct, &mut |_| {})
}

/// [`read_range`] that also hands the bytes, in order and in pieces, to `on_data` as they arrive.
/// For reads longer than one block `on_data` runs on a helper thread while the next block is
/// read, so a checksum over the data costs (almost) no extra time.
pub fn read_range_streaming(
    path: &Path,
    offset: u64,
    len: usize,
    on_data: &mut (dyn FnMut(&[u8]) + Send),
) -> Result<(ReadBytes, ReadMode)> {
    read_range_with(path, offset, len, open_direct, on_data)
}

/// [`read_range_streaming`] with the `O_DIRECT` opener injectable (tests simulate a refusing
/// filesystem).
pub(crate) fn read_range_with(
    path: &Path,
    offset: u64,
    len: usize,
    open: impl Fn(&Path) -> io::Result<File>,
    on_data: &mut (dyn FnMut(&[u8]) + Send),
) -> Result<(ReadBytes, ReadMode)> {
    let done = match open(path) {
        Ok(f) => read_direct(&f, path, offset, len, on_data)?,
        Err(e) if is_einval(&e) => None,
        Err(e) => return Err(KernelError::io("opening (O_DIRECT)", path, e)),
    };
    match done {
        Some(bytes) => Ok((bytes, ReadMode::Direct)),
        None => {
            let bytes = fallback(path, offset, len)?;
            on_data(&bytes);
            Ok((bytes, ReadMode::BufferedFallback))
        }
    }
}

/// Fill `dst` from `offset`; returns the bytes read (fewer only at end of file).
fn read_block(f: &File, dst: &mut [u8], offset: u64) -> io::Result<usize> {
    loop {
        match f.read_at(dst, offset) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

/// `Ok(None)` when the first read is refused with EINVAL (nothing was passed to `on_data`).
fn read_direct(
    f: &File,
    path: &Path,
    offset: u64,
    len: usize,
    on_data: &mut (dyn FnMut(&[u8]) + Send),
) -> Result<Option<ReadBytes>> {
    let align = DIRECT_ALIGN as u64;
    let aligned_start = offset & !(align - 1);
    let skip = (offset - aligned_start) as usize;
    let want = skip.checked_add(len).ok_or_else(|| KernelError::invalid("read_range", "length overflows"))?;
    let total = want.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
    let mut buf = AlignedBuf::zeroed(total)?;
    let eof = || {
        KernelError::io(
            "reading (O_DIRECT)",
            path,
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("file ends before byte {}", offset + len as u64),
            ),
        )
    };
    let mut blocks = buf.as_mut_slice().chunks_mut(DIRECT_BLOCK);
    // The first block is read here, so a refused O_DIRECT is seen before any thread starts.
    let Some(first) = blocks.next() else {
        return Ok(Some(ReadBytes { buf: AlignedBuf::zeroed(0)?, start: 0, len: 0 }));
    };
    let n = match read_block(f, first, aligned_start) {
        Err(e) if is_einval(&e) => return Ok(None),
        Err(e) => return Err(KernelError::io("reading (O_DIRECT)", path, e)),
        Ok(n) => n,
    };
    let piece = |pos: usize, n: usize| (skip.saturating_sub(pos).min(n), want.saturating_sub(pos).min(n));
    let (lo, hi) = piece(0, n);
    let first: &[u8] = first;
    if n >= want || n < first.len() {
        // One block holds everything (or the file ended inside it): no thread needed.
        if n < want {
            return Err(eof());
        }
        on_data(&first[lo..hi]);
    } else {
        let mut pos = n;
        std::thread::scope(|sc| -> Result<()> {
            let (tx, rx) = std::sync::mpsc::sync_channel::<&[u8]>(2);
            let consumer = sc.spawn(move || {
                for p in rx {
                    on_data(p);
                }
            });
            let sent = tx.send(&first[lo..hi]);
            let mut result = sent.map_err(|_| KernelError::invalid("read_range", "consumer stopped"));
            for block in blocks.by_ref() {
                if result.is_err() || pos >= want {
                    break;
                }
                let block_len = block.len();
                match read_block(f, block, aligned_start + pos as u64) {
                    Ok(n) => {
                        let (lo, hi) = piece(pos, n);
                        let block: &[u8] = block;
                        if hi > lo && tx.send(&block[lo..hi]).is_err() {
                            result = Err(KernelError::invalid("read_range", "consumer stopped"));
                        }
                        pos += n;
                        if n < block_len {
                            break; // end of file inside this block: the unaligned tail is in.
                        }
                    }
                    Err(e) => result = Err(KernelError::io("reading (O_DIRECT)", path, e)),
                }
            }
            drop(tx);
            if consumer.join().is_err() {
                return Err(KernelError::invalid("read_range", "data consumer panicked"));
            }
            result?;
            if pos < want { Err(eof()) } else { Ok(()) }
        })?;
    }
    Ok(Some(ReadBytes { buf, start: skip, len }))
}

fn fallback(path: &Path, offset: u64, len: usize) -> Result<ReadBytes> {
    let f = File::open(path).map_err(|e| KernelError::io("opening (buffered fallback)", path, e))?;
    let mut buf = AlignedBuf::zeroed(len)?;
    f.read_exact_at(buf.as_mut_slice(), offset)
        .map_err(|e| KernelError::io("reading (buffered fallback)", path, e))?;
    // SAFETY: plain syscall on a valid fd; a failure only means the cache is kept.
    let rc = unsafe {
        libc::posix_fadvise(
            f.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        )
    };
    if rc != 0 {
        tracing::debug!(path = %path.display(), rc, "posix_fadvise(DONTNEED) failed");
    }
    Ok(ReadBytes { buf, start: 0, len })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_with(len: usize) -> (tempfile::TempDir, std::path::PathBuf, Vec<u8>) {
        // Under the target directory (a real disk), not /tmp (tmpfs on some CI runners).
        let exe = std::env::current_exe().unwrap();
        let dir = tempfile::tempdir_in(exe.parent().unwrap()).unwrap();
        let path = dir.path().join("data.bin");
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        File::create(&path).unwrap().write_all(&data).unwrap();
        (dir, path, data)
    }

    #[test]
    fn unaligned_ranges_and_tail() {
        // 2 blocks + an unaligned tail, so the last read is short.
        let len = 2 * DIRECT_BLOCK + 12_345;
        let (_d, path, data) = file_with(len);
        for (off, n) in [
            (0, len),
            (1, 10),
            (4095, 4098),
            (DIRECT_BLOCK - 3, DIRECT_BLOCK + 100),
            (4096, 2 * DIRECT_BLOCK),
            (len - 7, 7),
            (5, 0),
        ] {
            let mut seen = Vec::new();
            let (bytes, mode) =
                read_range_streaming(&path, off as u64, n, &mut |p| seen.extend_from_slice(p)).unwrap();
            assert_eq!(mode, ReadMode::Direct, "this disk accepts O_DIRECT");
            assert_eq!(&bytes[..], &data[off..off + n], "range {off}+{n}");
            assert_eq!(seen, &data[off..off + n], "streamed pieces of {off}+{n}");
        }
        for (off, n) in [((len - 5) as u64, 10), (100, len)] {
            let err = read_range(&path, off, n).unwrap_err().to_string();
            assert!(err.contains("file ends before"), "{err}");
        }
    }

    #[test]
    fn refused_direct_falls_back_and_reports() {
        let (_d, path, data) = file_with(10_000);
        let refuse = |_: &Path| -> io::Result<File> { Err(io::Error::from_raw_os_error(libc::EINVAL)) };
        let mut seen = Vec::new();
        let (bytes, mode) =
            read_range_with(&path, 3, 9_000, refuse, &mut |p| seen.extend_from_slice(p)).unwrap();
        assert_eq!(mode, ReadMode::BufferedFallback);
        assert_eq!(&bytes[..], &data[3..9_003]);
        assert_eq!(seen, &data[3..9_003]);
        let other = |_: &Path| -> io::Result<File> { Err(io::Error::from_raw_os_error(libc::EACCES)) };
        assert!(read_range_with(&path, 0, 1, other, &mut |_| {}).is_err(), "only EINVAL falls back");
    }
}
