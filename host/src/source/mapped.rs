//! Input files read through a memory map: records are parsed where the kernel keeps the
//! file (its page cache), without the copy `read()` makes of every byte. On a job with few
//! keys that copy (and the page-cache lookups around it) took about 15% of the CPU.
//!
//! A mapped file that shrinks while it is read (another process truncates it) would kill
//! the process with SIGBUS at the next access past its new end. A SIGBUS handler turns
//! such a fault inside one of these mappings into a page of zeros and notes that the file
//! shrank; the reader checks that note before it hands out a record (one scanned where it
//! lies: right after it, and a record scanned so can only end at a line break, which no
//! zero is), and fails with a clear error; checkpoints check it too, and the file's
//! length, before they keep a position (a kernel that maps a large folio past a cut may
//! show zeros there without a fault). A fault anywhere
//! else goes to the handler that was there before (the standard library's; wasmtime's on
//! platforms where it takes SIGBUS) or to the default action, as if this one were not
//! installed.
//!
//! Where a map cannot be had (an empty file, a full table of mappings, a file system
//! without mmap), the reader uses `read()`.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, Once, OnceLock};

/// Mappings open at once; more files are read with `read()`.
const REGIONS: usize = 64;

/// Bytes of the mapping a reader gives back (drops from its resident set) at a time,
/// once it has read past them; and maps ahead of where it reads, in one system call
/// rather than a page fault every few pages. 16 MiB rather than 4: +0.7% on 10 000 keys
/// (a quarter of the calls, and of the TLB flushes a release sends the other threads),
/// for up to 24 MiB more of the file's (clean, shared) pages in the resident set.
const RELEASE: usize = 16 << 20;

/// `madvise` advice: map the range's pages now (Linux 5.14); older kernels refuse it and
/// the pages fault in as they are read. Not in the `libc` crate's list yet.
const MADV_POPULATE_READ: libc::c_int = 22;

/// Bytes searched for a newline before the note of a shrunken file is looked at again.
const SEARCH: usize = 1 << 20;

/// How far ahead of a record the reader asks the processor for the next one (three cache
/// lines, about a record of the reference streams). The newline search (or the scan of a
/// record taken where it lies) is the first to touch a record's bytes and would wait for
/// memory on each of its lines; asked for a
/// kilobyte (a few records) early, they arrive while the records before are processed:
/// +6% on 10 000 keys, +2% on 1 000. 512 B to 2 KiB measured the same; 4 KiB ahead with
/// a hint that skips the outer caches was slower.
const PREFETCH_AHEAD: usize = 1024;
const PREFETCH_LINES: usize = 3;

/// How far behind a record the reader tells the processor that the lines it read may
/// leave the core's caches (CLDEMOTE, a hint; a NOP on processors without it). The input
/// streams through the core's 2 MiB L2 at ~190 bytes a record, and pushes out the key
/// index and window state that the next records look up (with 10 000 keys, ~1.9 MB of
/// input pass between two records of one key): demoted, the input goes to the shared
/// cache first. +2% on 10 000 keys (interleaved, 10 runs each).
const DEMOTE_BEHIND: usize = 512;

/// The file shrank under its mapping.
#[derive(Debug)]
pub struct Shrank;

/// One mapping, as the signal handler sees it: `[start, end)`, or free when `start` is 0.
struct Region {
    start: AtomicUsize,
    end: AtomicUsize,
    shrank: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Region =
    Region { start: AtomicUsize::new(0), end: AtomicUsize::new(0), shrank: AtomicBool::new(false) };
static TABLE: [Region; REGIONS] = [FREE; REGIONS];
/// Taken to claim or free a region (never in the handler, which only loads).
static CLAIM: Mutex<()> = Mutex::new(());
static PAGE: AtomicUsize = AtomicUsize::new(4096);
static INSTALL: Once = Once::new();
/// Whether the handler is installed (mapping without it is not safe).
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The SIGBUS action before ours.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// A whole file, mapped read-only.
pub struct Mapped {
    file: File,
    ptr: NonNull<u8>,
    len: usize,
    region: usize,
    /// Bytes before this offset were given back ([`Mapped::release_before`]).
    released: usize,
}

// SAFETY: the mapping is owned by this value alone and is only read.
unsafe impl Send for Mapped {}

impl Mapped {
    /// Map `file` (a regular file of `len` bytes); None when it cannot be mapped safely
    /// (then read it with `read()`).
    pub fn open(file: &File, len: u64) -> Option<Mapped> {
        let file = file.try_clone().ok()?;
        let len = usize::try_from(len).ok().filter(|&l| l > 0)?;
        install();
        if !INSTALLED.load(Ordering::Acquire) {
            return None;
        }
        let _claim = CLAIM.lock().ok()?;
        let region = TABLE.iter().position(|r| r.start.load(Ordering::Acquire) == 0)?;
        // A fresh read-only private mapping of the open file, at an address the kernel can
        // map its 2 MiB folios at. Accesses past a shrunken end are caught by `on_sigbus`.
        let p = map_aligned(&file, len)?;
        let ptr = NonNull::new(p.cast::<u8>())?;
        // SAFETY: advice on the mapping just made; failure is harmless (an old kernel, a
        // file system without large folios: pages as they come).
        // Huge pages: what the kernel reads ahead for this mapping it keeps in 2 MiB folios,
        // and (the mapping being aligned to them: `map_aligned`) maps one at a time,
        // instead of 512 page-table entries set and then cleared again by `release`. On
        // 1 000 keys, a file read from disk cost 7% less CPU, and every later run over it
        // (the folios stay in the page cache) 3% less; a file just written (its folios are
        // the writer's) about 1% less. The alignment: +1.5% on 10 000 keys (without it the
        // kernel mapped none of the folios whole: `FilePmdMapped` stayed 0).
        unsafe {
            libc::madvise(p, len, libc::MADV_SEQUENTIAL);
            libc::madvise(p, len, libc::MADV_HUGEPAGE);
        }
        let r = &TABLE[region];
        r.shrank.store(false, Ordering::Release);
        r.end.store(ptr.as_ptr() as usize + len, Ordering::Release);
        r.start.store(ptr.as_ptr() as usize, Ordering::Release);
        Some(Mapped { file, ptr, len, region, released: 0 })
    }

    /// The file's bytes: what the file holds now, so another process's write shows
    /// through, and zeros past an end that moved back (the usual caveat of a mapped file,
    /// why memmap2 makes mapping `unsafe`). The reader reads each byte of a record once,
    /// in the newline search (or the scan of a record taken where it lies, which ends only
    /// at a line break, a byte no zero past a cut can be), and checks [`Mapped::shrank`]
    /// after it; nothing may assume that a byte read twice reads the same.
    #[inline]
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes are mapped readable for as long as `self` lives; a page the
        // kernel takes away (the file shrank) is replaced by zeros in `on_sigbus`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Offset from `from` of the first newline in `from..to`, searched [`SEARCH`] bytes at a
    /// time: past a cut the file reads as zeros, and the search stops within a window of
    /// it (instead of faulting its way through the rest of the mapping).
    #[inline]
    pub fn newline(&self, from: usize, to: usize) -> Result<Option<usize>, Shrank> {
        let bytes = self.bytes();
        prefetch_after(bytes, from);
        let mut at = from;
        loop {
            let upto = to.min(at.saturating_add(SEARCH));
            if let Some(i) = memchr::memchr(b'\n', &bytes[at..upto]) {
                return Ok(Some(at - from + i));
            }
            if upto == to {
                return Ok(None);
            }
            if self.shrank() {
                return Err(Shrank);
            }
            at = upto;
        }
    }

    /// Whether the file shrank under the mapping: bytes read since may be zeros.
    #[inline]
    pub fn shrank(&self) -> bool {
        TABLE[self.region].shrank.load(Ordering::Acquire)
    }

    /// Whether the file is longer now than when it was mapped (a writer appended to it).
    pub fn grew(&self) -> bool {
        self.file.metadata().is_ok_and(|m| m.len() > self.len as u64)
    }

    /// The file, open (for reading on with `read()` when it grew).
    pub fn file(&self) -> std::io::Result<File> {
        self.file.try_clone()
    }

    /// At the end of the mapping: whether the file is shorter than it was mapped. A cut
    /// inside the last page faults nowhere (the page stays, zeros past the cut): only
    /// the file's length tells.
    pub fn shrank_at_end(&self) -> bool {
        self.shrank() || self.file.metadata().map_or(true, |m| m.len() < self.len as u64)
    }

    /// The reader is past `offset`: give the pages before it back, in steps of
    /// [`RELEASE`] bytes (the file stays in the page cache; the process's resident set no
    /// longer counts it), and map the [`RELEASE`] bytes after the next ones ahead (a
    /// failure, on an old kernel or a file cut short, is harmless: reading faults them in).
    #[inline]
    pub fn release_before(&mut self, offset: usize) {
        if offset >= self.released + RELEASE {
            self.release(offset);
        }
    }

    #[cold]
    #[inline(never)]
    fn release(&mut self, offset: usize) {
        // Whole 2 MiB pages (the mapping starts at a multiple of them, or of the page
        // size): giving back part of one would split it into small pages first.
        let unit = PAGE.load(Ordering::Relaxed).max(HUGE);
        let upto = offset / unit * unit;
        if upto <= self.released {
            return;
        }
        // SAFETY: the range lies in the mapping and page-aligned; bytes before `offset`
        // are not read again (a read would fault them back in from the file).
        unsafe {
            libc::madvise(
                self.ptr.as_ptr().add(self.released).cast(),
                upto - self.released,
                libc::MADV_DONTNEED,
            )
        };
        self.released = upto;
        let end = upto.saturating_add(2 * RELEASE).min(self.len);
        let from = upto.saturating_add(RELEASE).min(end);
        // SAFETY: advice on a range inside the mapping; it only maps pages.
        unsafe { libc::madvise(self.ptr.as_ptr().add(from).cast(), end - from, MADV_POPULATE_READ) };
    }
}

/// Ask for the record after the one at `from` in `input` ahead of its reading (see
/// [`PREFETCH_AHEAD`]), and let the lines [`DEMOTE_BEHIND`] it go (see there): readers of
/// the input call it at each record.
#[inline(always)]
pub fn prefetch_after(input: &[u8], from: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let ahead = from.saturating_add(PREFETCH_AHEAD);
        if ahead < input.len() {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let p = input.as_ptr().wrapping_add(ahead).cast::<i8>();
            for line in 0..PREFETCH_LINES {
                // SAFETY: a prefetch is a hint: it reads nothing the program sees and
                // never faults (on a page cut from a shrunken file it is dropped).
                unsafe { _mm_prefetch(p.wrapping_add(64 * line), _MM_HINT_T0) };
            }
        }
        if let Some(behind) = from.checked_sub(DEMOTE_BEHIND) {
            let p = input.as_ptr().wrapping_add(behind);
            for line in 0..PREFETCH_LINES {
                // SAFETY: CLDEMOTE is a hint, encoded as a NOP on processors without it: it
                // reads and writes nothing the program sees, and never faults.
                unsafe {
                    std::arch::asm!(
                        "cldemote [{0}]",
                        in(reg) p.wrapping_add(64 * line),
                        options(nostack, preserves_flags, readonly)
                    );
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (input, from);
}

impl Drop for Mapped {
    fn drop(&mut self) {
        let _claim = CLAIM.lock();
        let r = &TABLE[self.region];
        r.start.store(0, Ordering::Release);
        // SAFETY: the mapping made in `open`, no longer referenced.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        r.end.store(0, Ordering::Release);
    }
}

/// Install the SIGBUS handler once, keeping the action it replaces.
fn install() {
    INSTALL.call_once(|| {
        // SAFETY: sysconf and sigaction with valid arguments; the previous action is
        // stored before ours is installed, so the handler always finds it.
        unsafe {
            let page = libc::sysconf(libc::_SC_PAGESIZE);
            if page > 0 {
                PAGE.store(page as usize, Ordering::Relaxed);
            }
            let mut new: libc::sigaction = std::mem::zeroed();
            new.sa_sigaction = on_sigbus as *const () as usize;
            new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
            libc::sigemptyset(&mut new.sa_mask);
            // One call swaps the actions: none installed in between is lost. (No mapping
            // exists yet, so nothing of ours faults before `PREVIOUS` is set; a fault of
            // someone else's in that instant takes the default action.)
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &new, &mut old) == 0 {
                let _ = PREVIOUS.set(old);
                INSTALLED.store(true, Ordering::Release);
            }
        }
    });
}

/// SIGBUS: in one of our mappings, the file shrank under it: map zeros over the page and
/// note it (the access then reads zeros); anywhere else, what would have happened
/// without this handler. Only loads atomics and makes system calls (async-signal-safe).
extern "C" fn on_sigbus(signum: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: the kernel gives an SA_SIGINFO handler a valid siginfo; errno is the
    // thread's own, saved around the system calls made here.
    let (code, addr, errno) =
        unsafe { ((*info).si_code, (*info).si_addr() as usize, *libc::__errno_location()) };
    // Only an access past the end of a file (BUS_ADRERR) is ours to mend: a hardware memory
    // error, an I/O error or a signal sent by a process (si_code <= 0) is not.
    if code == libc::BUS_ADRERR && mend(addr) {
        // SAFETY: restores the thread's errno.
        unsafe { *libc::__errno_location() = errno };
        return;
    }
    // SAFETY: as wasmtime's delegation: call the previous handler as it was registered,
    // or restore the default (or ignore) action and return, so that the fault repeats
    // under it; a signal sent by a process is raised again under that action.
    unsafe {
        match PREVIOUS.get() {
            Some(prev) if prev.sa_sigaction != libc::SIG_DFL && prev.sa_sigaction != libc::SIG_IGN => {
                if prev.sa_flags & libc::SA_SIGINFO != 0 {
                    std::mem::transmute::<
                        usize,
                        extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void),
                    >(prev.sa_sigaction)(signum, info, context)
                } else {
                    std::mem::transmute::<usize, extern "C" fn(libc::c_int)>(prev.sa_sigaction)(signum)
                }
            }
            prev => {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(signum, prev.unwrap_or(&dfl), std::ptr::null_mut());
                if code <= 0 {
                    libc::raise(signum);
                }
            }
        }
    }
}

/// A fault at `addr`: inside one of our mappings, map zeros over its page and note that
/// the file shrank; false when the address is not ours (or the page cannot be mended).
fn mend(addr: usize) -> bool {
    let page = PAGE.load(Ordering::Relaxed);
    for r in &TABLE {
        let start = r.start.load(Ordering::Acquire);
        let end = r.end.load(Ordering::Acquire);
        // A region freed and claimed again between the two loads: not a whole one.
        if start != r.start.load(Ordering::Acquire) {
            continue;
        }
        if start != 0 && addr >= start && addr < end {
            let at = addr & !(page - 1);
            // SAFETY: replaces one page of our own read-only mapping with zeros.
            let p = unsafe {
                libc::mmap(
                    at as *mut libc::c_void,
                    page,
                    libc::PROT_READ,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                r.shrank.store(true, Ordering::Release);
                return true;
            }
        }
    }
    false
}

/// Huge pages: the mapping's start is a multiple of 2 MiB, as the file's offset 0 is, so
/// that a 2 MiB folio of the file's page cache can be mapped by one page-table entry.
const HUGE: usize = 2 << 20;

/// Map `len` bytes of `file` read-only, at an address that is a multiple of [`HUGE`] when
/// it can be had: reserve `len + HUGE` bytes of address space, map the file over its first
/// aligned part, give back the rest; else where the kernel puts it. None when the kernel
/// refuses.
fn map_aligned(file: &File, len: usize) -> Option<*mut libc::c_void> {
    let anywhere = || {
        // SAFETY: a fresh read-only private mapping of an open file; the kernel picks the
        // address.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_PRIVATE, file.as_raw_fd(), 0)
        };
        (p != libc::MAP_FAILED).then_some(p)
    };
    let page = PAGE.load(Ordering::Relaxed);
    let span = len.div_ceil(page) * page;
    // SAFETY: a fresh reservation (no access, no memory committed) the kernel places.
    let reserved = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span + HUGE,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if reserved == libc::MAP_FAILED {
        return anywhere();
    }
    let start = reserved as usize;
    let aligned = start.next_multiple_of(HUGE);
    // SAFETY: `aligned..aligned + span` lies in the reservation just made, which nothing
    // else uses: MAP_FIXED replaces that part of it with the file.
    let p = unsafe {
        libc::mmap(
            aligned as *mut libc::c_void,
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_FIXED,
            file.as_raw_fd(),
            0,
        )
    };
    // SAFETY: the parts of the reservation before and after the file's place are ours to
    // give back. (When the file could not be mapped, its place is left reserved: a kernel
    // may have cleared it already, and another thread's mapping may have taken it since.)
    unsafe {
        if aligned > start {
            libc::munmap(reserved, aligned - start);
        }
        let end = start + span + HUGE;
        if aligned + span < end {
            libc::munmap((aligned + span) as *mut libc::c_void, end - (aligned + span));
        }
    }
    if p == libc::MAP_FAILED {
        return anywhere();
    }
    Some(p)
}
