//! [`Bytes`]: the storage every weight kernel reads from, either owned
//! memory or a byte range of a memory-mapped model file. A weight kept in
//! its file's layout borrows the mapping (no copy, no decode at load); a
//! weight whose layout the kernels change (tiles, shards gathered from
//! strided rows) owns its bytes.

use std::ops::{Deref, Range};
use std::sync::Arc;

/// Immutable weight bytes, owned or mapped. Cloning shares the storage.
///
/// Invariant: a `Mapped` range lies inside its mapping (checked by
/// [`Bytes::mapped`]).
#[derive(Clone)]
pub enum Bytes {
    /// Bytes in anonymous memory.
    Owned(Arc<[u8]>),
    /// `range` of a read-only file mapping.
    Mapped {
        map: Arc<memmap2::Mmap>,
        range: Range<usize>,
    },
}

impl Bytes {
    /// Bytes `range` of `map`; `None` when the range is not inside it.
    pub fn mapped(map: Arc<memmap2::Mmap>, range: Range<usize>) -> Option<Bytes> {
        (range.start <= range.end && range.end <= map.len()).then_some(Bytes::Mapped { map, range })
    }

    /// A sub-range of these bytes, sharing the storage; `None` when it is
    /// not inside them.
    pub fn slice(&self, r: Range<usize>) -> Option<Bytes> {
        if r.start > r.end || r.end > self.len() {
            return None;
        }
        Some(match self {
            Bytes::Owned(_) if r.start == 0 && r.end == self.len() => self.clone(),
            Bytes::Owned(b) => Bytes::Owned(b[r].into()),
            Bytes::Mapped { map, range } => Bytes::Mapped {
                map: map.clone(),
                range: range.start + r.start..range.start + r.end,
            },
        })
    }

    /// Whether the bytes live in a file mapping (resident only as read).
    pub fn is_mapped(&self) -> bool {
        matches!(self, Bytes::Mapped { .. })
    }

    /// Drops this process's resident pages of mapped bytes whose contents
    /// were copied out (repacked into tiles, widened): read pages of a
    /// mapping count in the RSS until unmapped. Reading them again stays
    /// correct (a read-only private file mapping refills them from the
    /// file). Owned bytes are left alone.
    pub fn release(&self) {
        if let Bytes::Mapped { map, range } = self {
            // SAFETY: `range` lies inside `map` (the type's invariant), a
            // read-only file mapping.
            unsafe { release_file_pages(&map[range.clone()]) }
        }
    }
}

impl From<Vec<u8>> for Bytes {
    fn from(v: Vec<u8>) -> Self {
        Bytes::Owned(v.into())
    }
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Owned(b) => b,
            Bytes::Mapped { map, range } => &map[range.clone()],
        }
    }
}

/// `MADV_DONTNEED` on the whole pages inside `bytes` (see
/// [`Bytes::release`]; Linux only); a failure only leaves them resident.
///
/// # Safety
/// `bytes` must lie in a read-only (never written) private file mapping:
/// on anonymous memory this would zero the pages.
pub(crate) unsafe fn release_file_pages(bytes: &[u8]) {
    const PAGE: usize = 4096;
    let start = (bytes.as_ptr() as usize).next_multiple_of(PAGE);
    let end = (bytes.as_ptr() as usize + bytes.len()) / PAGE * PAGE;
    #[cfg(target_os = "linux")]
    if end > start {
        // SAFETY: `start..end` lies inside `bytes`; the caller promises a
        // read-only file mapping, whose dropped pages read back the same.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
    }
    // Elsewhere MADV_DONTNEED on a file mapping is only a hint: nothing.
    #[cfg(not(target_os = "linux"))]
    let _ = (start, end);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_ranges_are_checked_and_sliced() {
        let path = std::env::temp_dir().join(format!("specgate-bytes-{}", std::process::id()));
        std::fs::write(&path, (0u8..100).collect::<Vec<_>>()).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: the file is ours and not modified while mapped.
        let map = Arc::new(unsafe { memmap2::Mmap::map(&file) }.unwrap());
        std::fs::remove_file(&path).unwrap();
        assert!(Bytes::mapped(map.clone(), 90..101).is_none());
        let b = Bytes::mapped(map, 10..30).unwrap();
        assert_eq!(&b[..3], &[10, 11, 12]);
        let s = b.slice(5..7).unwrap();
        assert_eq!(&*s, &[15, 16]);
        assert!(b.slice(19..21).is_none());
        let o = Bytes::from(vec![1, 2, 3]);
        assert_eq!(&*o.slice(1..3).unwrap(), &[2, 3]);
        assert!(!o.is_mapped() && s.is_mapped());
    }
}
