//! Buffers whose first value starts a 64-byte cache line.
//!
//! A `Vec` of 4-byte values starts where the allocator puts it: 16 bytes into a line on
//! glibc. The packed panels' rows are 128 bytes and the AMX tiles' rows 64, so from such a
//! start every 64-byte vector or tile row load reads two lines instead of one (measured: the
//! AMX products of a many-row forward ran at half their speed). The kernels' packed operands
//! therefore live in [`Aligned`] buffers, aligned whatever the allocator does and kept so by
//! `clone`.

use std::marker::PhantomData;

/// One cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Values for which every bit pattern is a value, with an alignment of at most 64 bytes:
/// what an [`Aligned`] buffer may hold.
///
/// # Safety
/// Implementors are plain numbers: no padding, no invalid bit patterns, no drop glue.
pub(crate) unsafe trait Plain: Copy + Send + Sync + 'static {}
// SAFETY: plain integers and floats.
unsafe impl Plain for u8 {}
unsafe impl Plain for i8 {}
unsafe impl Plain for u16 {}
unsafe impl Plain for u32 {}
unsafe impl Plain for i32 {}
unsafe impl Plain for f32 {}

/// `len` values of `T` in whole cache lines, the first at the start of a line (the bytes past
/// the last value, up to the line's end, are zeros).
#[derive(Clone)]
pub(crate) struct Aligned<T: Plain> {
    lines: Vec<Line>,
    len: usize,
    _values: PhantomData<T>,
}

impl<T: Plain> Aligned<T> {
    /// `len` zeros.
    pub(crate) fn zeroed(len: usize) -> Self {
        let bytes = len * std::mem::size_of::<T>();
        Self {
            lines: vec![Line([0; 64]); bytes.div_ceil(64)],
            len,
            _values: PhantomData,
        }
    }

    /// Makes the buffer `len` zeros, reusing its lines when they suffice.
    pub(crate) fn reset(&mut self, len: usize) {
        let bytes = len * std::mem::size_of::<T>();
        self.lines.clear();
        self.lines.resize(bytes.div_ceil(64), Line([0; 64]));
        self.len = len;
    }

    /// Bytes the buffer holds without reallocating.
    pub(crate) fn capacity_bytes(&self) -> usize {
        self.lines.capacity() * 64
    }

    /// A copy of `values`.
    pub(crate) fn from_slice(values: &[T]) -> Self {
        let mut out = Self::zeroed(values.len());
        out.copy_from_slice(values);
        out
    }
}

impl<T: Plain> Default for Aligned<T> {
    fn default() -> Self {
        Self::zeroed(0)
    }
}

impl<T: Plain> From<Vec<T>> for Aligned<T> {
    fn from(values: Vec<T>) -> Self {
        Self::from_slice(&values)
    }
}

impl<T: Plain> std::ops::Deref for Aligned<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: the lines hold at least `len` values' bytes, aligned for `T` (at most 64),
        // and every bit pattern is a `T` (`Plain`).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Plain> std::ops::DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as `deref`, through the unique borrow of the lines.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Plain + std::fmt::Debug> std::fmt::Debug for Aligned<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_start_a_line_and_keep_their_values() {
        for len in [0usize, 1, 15, 16, 17, 1000] {
            let values: Vec<u32> = (0..len as u32).collect();
            let a = Aligned::from(values.clone());
            let b = a.clone();
            for buf in [&a, &b] {
                assert_eq!(buf.as_ptr() as usize % 64, 0, "len {len}");
                assert_eq!(&buf[..], &values[..]);
            }
            let mut z = Aligned::<f32>::zeroed(len);
            assert!(z.iter().all(|&v| v == 0.0));
            z.iter_mut().for_each(|v| *v = 1.5);
            assert_eq!(z.len(), len);
            assert!(z.iter().all(|&v| v == 1.5));
            z.reset(len / 2);
            assert_eq!(z.as_ptr() as usize % 64, 0);
            assert!(z.len() == len / 2 && z.iter().all(|&v| v == 0.0));
        }
    }
}
