//! Buffers whose first value starts a 64-byte cache line.
//!
//! A `Vec` of 4-byte values starts where the allocator puts it: 16 bytes into a line on
//! glibc. The packed panels' rows are 128 bytes and the AMX tiles' rows 64, so from such a
//! start every 64-byte vector or tile row load reads two lines instead of one (measured: the
//! AMX products of a many-row forward ran at half their speed). The kernels' packed operands
//! therefore live in [`Aligned`] buffers, aligned whatever the allocator does and kept so by
//! `clone`.

use std::marker::PhantomData;
use std::mem::MaybeUninit;

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

    /// `len` values, every one written by `write` (the buffer is not zeroed first; the bytes
    /// past the last value in its line are zeroed after).
    ///
    /// # Safety
    /// `write` initialises every value of the slice it is given.
    pub(crate) unsafe fn written(len: usize, write: impl FnOnce(&mut [MaybeUninit<T>])) -> Self {
        let mut lines = room::<T>(len);
        // SAFETY: the allocation has room for `len` values of a `T` of at most 64-byte
        // alignment; the caller writes each one, so `seal` may take them as written.
        unsafe {
            write(std::slice::from_raw_parts_mut(
                lines.as_mut_ptr().cast::<MaybeUninit<T>>(),
                len,
            ));
            seal(lines, len)
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
}

/// An [`Aligned`] buffer of a known length written front to back (how packers make their
/// panels: into the aligned lines directly, not into a `Vec` copied afterwards, and not zeroed
/// first: every value is written once).
pub(crate) struct Filling<T: Plain> {
    /// Room for the lines; none of them counted as written until [`Filling::finish`].
    lines: Vec<Line>,
    len: usize,
    at: usize,
    _values: PhantomData<T>,
}

impl<T: Plain> Filling<T> {
    /// A buffer of `len` values, none written yet.
    pub(crate) fn new(len: usize) -> Self {
        Self {
            lines: room::<T>(len),
            len,
            at: 0,
            _values: PhantomData,
        }
    }

    /// Writes `values` after those written so far.
    pub(crate) fn extend(&mut self, values: impl IntoIterator<Item = T>) {
        let first = self.lines.as_mut_ptr().cast::<T>();
        for v in values {
            assert!(self.at < self.len, "a packer wrote past its buffer");
            // SAFETY: value `at` lies inside the lines' allocation (checked above), which a
            // `T` of at most 64-byte alignment may occupy at any multiple of its size.
            unsafe { first.add(self.at).write(v) };
            self.at += 1;
        }
    }

    /// The buffer, every value written (the bytes past the last one in its line zeroed).
    pub(crate) fn finish(self) -> Aligned<T> {
        assert_eq!(
            self.at, self.len,
            "a packer wrote the wrong number of values"
        );
        // SAFETY: all `len` values were written (the assert).
        unsafe { seal(self.lines, self.len) }
    }
}

/// Unwritten room for `len` values of `T` in whole lines.
fn room<T: Plain>(len: usize) -> Vec<Line> {
    Vec::with_capacity((len * std::mem::size_of::<T>()).div_ceil(64))
}

/// The buffer of `len` values written at the start of `lines`' room (made by [`room`]): the
/// bytes past the last value, to its line's end, are zeroed and the lines counted.
///
/// # Safety
/// The first `len` values of `T` in the room are written.
unsafe fn seal<T: Plain>(mut lines: Vec<Line>, len: usize) -> Aligned<T> {
    let used = len * std::mem::size_of::<T>();
    let count = used.div_ceil(64);
    assert!(lines.capacity() >= count, "room for the values");
    // SAFETY: the bytes from `used` to the last line's end are inside the allocation; with
    // them zeroed every byte of the `count` lines is written, and `Line` is plain bytes.
    unsafe {
        std::ptr::write_bytes(
            lines.as_mut_ptr().cast::<u8>().add(used),
            0,
            count * 64 - used,
        );
        lines.set_len(count);
    }
    Aligned {
        lines,
        len,
        _values: PhantomData,
    }
}

impl<T: Plain> Default for Aligned<T> {
    fn default() -> Self {
        Self::zeroed(0)
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
            let mut f = Filling::new(len);
            f.extend(values.iter().copied());
            let a = f.finish();
            let b = a.clone();
            for buf in [&a, &b] {
                assert_eq!(buf.as_ptr() as usize % 64, 0, "len {len}");
                assert_eq!(&buf[..], &values[..]);
                // Whole lines, the bytes past the last value zeros (a filled buffer's were
                // never zeroed before the packer wrote it).
                assert_eq!(buf.lines.len(), (len * 4).div_ceil(64));
                let bytes: Vec<u8> = buf.lines.iter().flat_map(|l| l.0).collect();
                assert!(bytes[len * 4..].iter().all(|&b| b == 0), "len {len}");
            }
            // Written in place by a closure: the same values and zeroed tail.
            // SAFETY: the closure writes every value.
            let w = unsafe {
                Aligned::<u32>::written(len, |dst| {
                    for (d, &v) in dst.iter_mut().zip(&values) {
                        d.write(v);
                    }
                })
            };
            assert_eq!(w.as_ptr() as usize % 64, 0, "len {len}");
            assert_eq!(&w[..], &values[..]);
            assert_eq!(w.lines.len(), (len * 4).div_ceil(64));
            let bytes: Vec<u8> = w.lines.iter().flat_map(|l| l.0).collect();
            assert!(bytes[len * 4..].iter().all(|&b| b == 0), "len {len}");
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

    #[test]
    #[should_panic(expected = "wrong number of values")]
    fn a_packer_that_writes_too_few_values_is_caught() {
        let mut f = Filling::<u8>::new(70);
        f.extend(0..69u8);
        f.finish();
    }

    #[test]
    #[should_panic(expected = "past its buffer")]
    fn a_packer_that_writes_too_many_values_is_caught() {
        let mut f = Filling::<u16>::new(3);
        f.extend([1u16, 2, 3, 4]);
    }
}
