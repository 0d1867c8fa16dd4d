//! The embedded default source: JSON lines from files (or standard input), one
//! partition per file.
//!
//! Each file is mapped into memory ([`super::mapped`]) and split with `memchr`, handing out
//! borrowed slices, so the cost per record is a scan for the newline; or, when the job's
//! scanner knows the record's layout, not even that: it scans the record where it lies and
//! tells where it ends ([`FileSource::next_records_framed`]); standard input, a
//! followed file and a file that cannot be mapped are read in large chunks with `read()`
//! instead. Blank lines are skipped. Several files are read round-robin, one record from
//! each in turn, which is deterministic and lets a lagging partition hold the watermark
//! back as a slow Kafka partition would. A partition's position is the byte offset after the last record
//! handed out, so a savepoint resumes exactly at the next record.

use super::mapped::Mapped;
use super::{Framed, PartitionPosition, Position, SourcePosition, Took};
use crate::{Error, Result};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// The most input ahead of a record offered to [`FileSource::next_records_framed`]'s `take`.
const FRAMED_AHEAD: usize = 64 << 10;

/// Read size: small enough that what a read copies is still in the cache when its
/// records are parsed.
const CHUNK: usize = 256 << 10;

/// Several files, read round-robin.
pub struct FileSource {
    parts: Vec<LineReader>,
    /// Partition to read next.
    next: usize,
    /// Partitions whose input has ended and that were not reported yet.
    ended: Vec<u32>,
    /// A file that ended right after a run of records: reported with the next call's
    /// `End` ([`FileSource::next_records_framed`]).
    ended_after_run: Vec<u32>,
    /// Records handed out, over all partitions (the sum of theirs, kept: it is asked
    /// after every record).
    records: u64,
}

/// What the input ahead is offered to: it takes records there, counted in its [`Took`].
type Take = fn(&[u8], Position, u64, &mut Took) -> Result<()>;

impl FileSource {
    /// Open `paths` as partitions 0..n, resuming each at its saved position (matched by
    /// partition number).
    pub fn open(paths: &[PathBuf], resume: Option<&SourcePosition>) -> Result<FileSource> {
        Self::open_with(paths, false, resume)
    }

    /// As [`FileSource::open`]; with `follow`, the files are read as they grow and never
    /// end (an unbounded source).
    pub fn open_with(paths: &[PathBuf], follow: bool, resume: Option<&SourcePosition>) -> Result<FileSource> {
        Self::open_parts(paths, follow, !follow, resume)
    }

    /// As [`FileSource::open_with`]; `map`: map the files that can be (else `read()`).
    fn open_parts(
        paths: &[PathBuf],
        follow: bool,
        map: bool,
        resume: Option<&SourcePosition>,
    ) -> Result<FileSource> {
        debug_assert!(!(map && follow), "a followed file grows: it is read, not mapped");
        if let Some(r) = resume {
            if r.kind != "file" {
                return Err(Error::Usage(format!(
                    "the checkpoint or savepoint was taken reading a {} source; this pipeline reads files",
                    r.kind
                )));
            }
            if r.partitions.len() != paths.len() {
                return Err(Error::Usage(format!(
                    "the savepoint read {} input partitions; this run has {}",
                    r.partitions.len(),
                    paths.len()
                )));
            }
        }
        let mut parts = Vec::with_capacity(paths.len());
        for (i, p) in paths.iter().enumerate() {
            let at = resume.and_then(|r| r.partitions.iter().find(|pp| pp.partition == i as u32));
            parts.push(LineReader::open(p, i as u32, follow, map, at)?);
        }
        let next = resume.map_or(0, |r| r.next as usize % parts.len().max(1));
        let records = parts.iter().map(|p| p.records).sum();
        Ok(FileSource { parts, next, ended: Vec::new(), ended_after_run: Vec::new(), records })
    }

    /// Records handed out so far, over all partitions (including before a resume).
    #[inline]
    pub fn records(&self) -> u64 {
        self.records
    }

    pub fn partitions(&self) -> usize {
        self.parts.len()
    }

    /// Name (path) of a partition.
    pub fn partition_name(&self, p: u32) -> String {
        self.parts[p as usize].path.display().to_string()
    }

    /// Partitions that ended since the last call.
    pub fn take_ended(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.ended)
    }

    /// The next record of the next partition that has one.
    pub fn next_record(&mut self) -> Result<Option<(&[u8], Position)>> {
        // No offer: nothing is done for one (no position made, no look at the input ahead).
        let no_take: Option<Take> = None;
        match self.next_offered(1, no_take)? {
            Framed::Record(record, pos) => Ok(Some((record, pos))),
            Framed::Taken | Framed::End => Ok(None),
        }
    }

    /// The next records, offered first to `take` where they start: `take` gets the input
    /// from there on (the rest of the file as far as it is mapped or read, many records),
    /// the first record's position and how many records it may take, and may take records
    /// one after another from the start when it can tell where each ends: it counts them
    /// and the bytes they cover in its [`Took`] (the record `k` after the first is at line
    /// `pos.line + k`, at the offset of the bytes before it). Each must be followed by a
    /// line break (`\n` or `\r\n`) and hold none (it is the line the newline search would
    /// find: [`crate::source::json::Projection::scan_framed`]). The first record it does
    /// not take is found by its line break and returned, as [`FileSource::next_record`]
    /// does.
    ///
    /// Up to `most` records (at least one) in a row, when there is one file: offered
    /// again after the records `take` took while it takes some (it may stop at the end of
    /// the input it was given), in one call (a call and the job loop's checks for each
    /// record cost about 100 instructions of its ~2 400). The first record it does not
    /// take ends the run, found by its line break and returned ([`Framed::Record`]), one
    /// of the `most`; [`Framed::Taken`]: `take` took the records read (at least one).
    /// Several files give one record a call, from each in turn.
    pub fn next_records_framed(
        &mut self,
        most: u64,
        take: impl FnMut(&[u8], Position, u64, &mut Took) -> Result<()>,
    ) -> Result<Framed<'_>> {
        self.next_offered(most, Some(take))
    }

    /// [`Self::next_records_framed`], offered to `take` when there is one.
    #[inline]
    fn next_offered(
        &mut self,
        most: u64,
        mut take: Option<impl FnMut(&[u8], Position, u64, &mut Took) -> Result<()>>,
    ) -> Result<Framed<'_>> {
        if !self.ended_after_run.is_empty() {
            self.ended.append(&mut self.ended_after_run);
            return Ok(Framed::End);
        }
        let n = self.parts.len();
        for _ in 0..n {
            let p = self.next;
            // Round robin over the files (no division: one a record).
            self.next = if p + 1 == n { 0 } else { p + 1 };
            if self.parts[p].done {
                continue;
            }
            let mut taken = 0;
            if let Some(mut take) = take.take() {
                let run = if n == 1 { most.max(1) } else { 1 };
                let done = self.parts[p].take_run(run, &mut take, &mut taken);
                // Counted even when a record fails the run.
                self.records += taken;
                done?;
                if taken == run {
                    return Ok(Framed::Taken);
                }
            }
            if self.parts[p].advance()? {
                self.records += 1;
                let part = &self.parts[p];
                return Ok(Framed::Record(&part.bytes()[part.rec.0..part.rec.1], part.rec_pos));
            }
            if taken > 0 {
                // The input read ends after the records taken: they come first, and the
                // end (the file's, when it ended) is the next call's `End`, as when they
                // came one a call.
                if self.parts[p].done {
                    self.ended_after_run.push(p as u32);
                }
                return Ok(Framed::Taken);
            }
            if self.parts[p].done {
                self.ended.push(p as u32);
            }
        }
        Ok(Framed::End)
    }

    /// Err when a mapped file shrank while it was read: a record handed out since the
    /// last check may have read zeros where the file was cut, so a position past it must
    /// not be kept (checked before a checkpoint or savepoint records the positions).
    pub fn check_intact(&self) -> Result<()> {
        self.parts.iter().try_for_each(LineReader::check_intact)
    }

    pub fn position(&self) -> SourcePosition {
        SourcePosition {
            kind: "file".into(),
            partitions: self.parts.iter().map(LineReader::position).collect(),
            next: self.next as u32,
        }
    }
}

/// One file, line by line.
struct LineReader {
    path: PathBuf,
    partition: u32,
    /// Keep reading past the end as the file grows.
    follow: bool,
    done: bool,
    /// The current record's range in `buf` and position.
    rec: (usize, usize),
    rec_pos: Position,
    input: Box<dyn Read>,
    /// What `read()` gave, from `offset` on; unused when the file is mapped.
    buf: Vec<u8>,
    /// The whole file, when mapped: `start` and `end` index it, `offset` is `start`.
    map: Option<Mapped>,
    start: usize,
    end: usize,
    eof: bool,
    /// File offset of `buf[start]`.
    offset: u64,
    lines: u64,
    records: u64,
}

impl LineReader {
    /// Open `path` (`-` for standard input), optionally resuming at `resume`.
    fn open(
        path: &Path,
        partition: u32,
        follow: bool,
        map: bool,
        resume: Option<&PartitionPosition>,
    ) -> Result<LineReader> {
        let mut mapped = None;
        let input: Box<dyn Read> = if path == Path::new("-") {
            if resume.is_some_and(|r| r.offset > 0) {
                return Err(Error::Usage(
                    "cannot resume standard input from a savepoint: give the input file with --input".into(),
                ));
            }
            Box::new(std::io::stdin())
        } else {
            let mut f = File::open(path).map_err(|e| Error::io("open input", path, e))?;
            let meta = f.metadata().map_err(|e| Error::io("stat input", path, e))?;
            if map && meta.is_file() {
                mapped = Mapped::open(&f, meta.len());
            }
            if let Some(r) = resume {
                let len = meta.len();
                if len < r.offset {
                    return Err(Error::Usage(format!(
                        "input {} has {len} bytes but the savepoint resumes at byte {}: not the same input",
                        path.display(),
                        r.offset
                    )));
                }
                f.seek(SeekFrom::Start(r.offset)).map_err(|e| Error::io("seek input", path, e))?;
            }
            Box::new(f)
        };
        let offset = resume.map_or(0, |r| r.offset);
        // A mapped file is all there from the start: `start` is the offset.
        let (buf, start, end) = match &mapped {
            Some(m) => (Vec::new(), offset as usize, m.bytes().len()),
            None => (vec![0; CHUNK], 0, 0),
        };
        Ok(LineReader {
            path: path.to_path_buf(),
            partition,
            follow,
            done: false,
            rec: (0, 0),
            rec_pos: Position { partition, line: 0, offset: 0 },
            input,
            buf,
            eof: mapped.is_some(),
            map: mapped,
            start,
            end,
            offset,
            lines: resume.map_or(0, |r| r.lines),
            records: resume.map_or(0, |r| r.records),
        })
    }

    /// Move to the next non-blank line (without its terminator); false at the end.
    fn advance(&mut self) -> Result<bool> {
        match self.next_line()? {
            Some((s, e, pos)) => {
                self.rec = (s, e);
                self.rec_pos = pos;
                Ok(true)
            }
            None => {
                self.done = !self.follow;
                Ok(false)
            }
        }
    }

    /// The bytes `start`, `end` and a record's range index.
    #[inline]
    fn bytes(&self) -> &[u8] {
        match &self.map {
            Some(m) => m.bytes(),
            None => &self.buf,
        }
    }

    /// Offer the input ahead to `take` (see [`FileSource::next_records_framed`]), while
    /// it takes records, up to `run` records; `taken` counts those it took (the reader is
    /// then past each and its line break).
    #[inline]
    fn take_run(
        &mut self,
        run: u64,
        take: &mut impl FnMut(&[u8], Position, u64, &mut Took) -> Result<()>,
        taken: &mut u64,
    ) -> Result<()> {
        // A mapping cut short is looked for before the run, and after each offer, as
        // after a newline search (`take` read every byte of its records and the line
        // break after each, and a record scanned where it lies ends at a line break, which
        // no zero of a page cut from the file is: the records it took are whole).
        if self.map.as_ref().is_some_and(Mapped::shrank) {
            return Err(self.shrank());
        }
        while *taken < run {
            // At most this much ahead: a longer record goes the newline search's way
            // (which, in a mapping cut short, stops within a window of the cut instead of
            // reading zeros to the mapping's end).
            let (s, end) = (self.start, self.end.min(self.start.saturating_add(FRAMED_AHEAD)));
            if s >= end {
                return Ok(());
            }
            let pos = Position { partition: self.partition, line: self.lines + 1, offset: self.offset };
            let mut took = Took::default();
            let result = take(&self.bytes()[s..end], pos, run - *taken, &mut took);
            debug_assert!(took.records <= run - *taken && took.bytes <= end - s);
            // Counted even when a record fails.
            self.start = s + took.bytes;
            self.offset += took.bytes as u64;
            self.lines += took.records;
            self.records += took.records;
            *taken += took.records;
            if let Some(m) = &mut self.map {
                m.release_before(self.start);
            }
            result?;
            if self.map.as_ref().is_some_and(Mapped::shrank) {
                return Err(self.shrank());
            }
            if took.records == 0 {
                return Ok(());
            }
        }
        Ok(())
    }

    fn next_line(&mut self) -> Result<Option<(usize, usize, Position)>> {
        let (s, e, pos) = loop {
            let (bytes, found) = match &self.map {
                Some(m) => (m.bytes(), m.newline(self.start, self.end).map_err(|_| self.shrank())?),
                None => (&self.buf[..], memchr::memchr(b'\n', &self.buf[self.start..self.end])),
            };
            if let Some(nl) = found {
                let s = self.start;
                let pos = Position { partition: self.partition, line: self.lines + 1, offset: self.offset };
                self.start += nl + 1;
                self.offset += nl as u64 + 1;
                self.lines += 1;
                let mut e = s + nl;
                if e > s && bytes[e - 1] == b'\r' {
                    e -= 1;
                }
                if is_blank(&bytes[s..e]) {
                    continue;
                }
                break (s, e, pos);
            }
            if self.eof {
                if self.follow {
                    // The file may grow: try again later; a last line without its
                    // newline is not complete yet.
                    self.eof = false;
                    return Ok(None);
                }
                if self.map.is_some() && self.read_on()? {
                    continue;
                }
                if self.start == self.end {
                    return Ok(None);
                }
                // Last line without a newline.
                let (s, e) = (self.start, self.end);
                let pos = Position { partition: self.partition, line: self.lines + 1, offset: self.offset };
                self.offset += (e - s) as u64;
                self.lines += 1;
                self.start = e;
                if is_blank(&self.bytes()[s..e]) {
                    continue;
                }
                break (s, e, pos);
            }
            self.fill()?;
        };
        if let Some(m) = &mut self.map {
            // Every byte of the record was read (by the newline search): had the file
            // shrunk under them, the note would be set by now.
            if m.shrank() {
                return Err(self.shrank());
            }
            m.release_before(s);
        }
        self.records += 1;
        Ok(Some((s, e, pos)))
    }

    /// At the end of a mapped file: Err if it shrank; if it was appended to since it was
    /// mapped, leave the mapping for `read()` at `offset` (the start of the line not yet
    /// handed out), as `read()` would have read on, and return true.
    #[cold]
    #[inline(never)]
    fn read_on(&mut self) -> Result<bool> {
        let file = match &self.map {
            Some(m) if m.shrank_at_end() => return Err(self.shrank()),
            Some(m) if m.grew() => m.file(),
            _ => return Ok(false),
        };
        let mut file = file.map_err(|e| Error::io("open input", &self.path, e))?;
        file.seek(SeekFrom::Start(self.offset)).map_err(|e| Error::io("seek input", &self.path, e))?;
        self.input = Box::new(file);
        self.map = None;
        self.buf = vec![0; CHUNK];
        (self.start, self.end, self.eof) = (0, 0, false);
        Ok(true)
    }

    /// Err when the file shrank under its mapping (bytes handed out may have been zeros).
    fn check_intact(&self) -> Result<()> {
        match &self.map {
            Some(m) if m.shrank_at_end() => Err(self.shrank()),
            _ => Ok(()),
        }
    }

    #[cold]
    fn shrank(&self) -> Error {
        Error::io(
            "read input",
            &self.path,
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "the file shrank while it was read (another process truncated it near byte {}): \
                     records past its new end are gone",
                    self.offset
                ),
            ),
        )
    }

    fn fill(&mut self) -> Result<()> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.end == self.buf.len() {
            // A line longer than the buffer: grow.
            self.buf.resize(self.buf.len() * 2, 0);
        }
        loop {
            match self.input.read(&mut self.buf[self.end..]) {
                Ok(0) => {
                    self.eof = true;
                    return Ok(());
                }
                Ok(n) => {
                    self.end += n;
                    return Ok(());
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::io("read input", &self.path, e)),
            }
        }
    }

    fn position(&self) -> PartitionPosition {
        PartitionPosition {
            partition: self.partition,
            name: self.path.display().to_string(),
            offset: self.offset,
            lines: self.lines,
            records: self.records,
            stop: None,
        }
    }
}

fn is_blank(line: &[u8]) -> bool {
    // JSON's whitespace only (RFC 8259 §2): a line of form feeds is a bad record.
    line.iter().all(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn collect(src: &mut FileSource) -> Vec<(String, Position)> {
        let mut out = Vec::new();
        while let Some((r, p)) = src.next_record().unwrap() {
            out.push((String::from_utf8(r.to_vec()).unwrap(), p));
        }
        out
    }

    #[test]
    fn lines_positions_and_resume() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.jsonl");
        std::fs::File::create(&path).unwrap().write_all(b"{\"a\":1}\r\n\n  \n{\"a\":2}\n{\"a\":3}").unwrap();
        let mut src = FileSource::open(std::slice::from_ref(&path), None).unwrap();
        let all = collect(&mut src);
        let texts: Vec<&str> = all.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(texts, ["{\"a\":1}", "{\"a\":2}", "{\"a\":3}"]);
        assert_eq!(all[1].1, Position { partition: 0, line: 4, offset: 13 });
        assert_eq!(all[2].1.line, 5);

        // Stop after the first two records and resume at the reported position.
        let mut src = FileSource::open(std::slice::from_ref(&path), None).unwrap();
        src.next_record().unwrap();
        src.next_record().unwrap();
        let pos = src.position();
        assert_eq!(pos.partitions[0].records, 2);
        let mut resumed = FileSource::open(std::slice::from_ref(&path), Some(&pos)).unwrap();
        let rest = collect(&mut resumed);
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].0, "{\"a\":3}");
        assert_eq!(rest[0].1, all[2].1);
        assert_eq!(resumed.records(), 3);
    }

    /// Every record, offered to a projection's framed scan first, as the job reads: in
    /// calls of up to `most` records (none past `stop_after`, as the job's loop bounds its
    /// runs), each checked to give at most that many.
    fn collect_framed(
        src: &mut FileSource,
        stop_after: usize,
        most: u64,
    ) -> (Vec<(String, Position)>, usize) {
        let mut p = crate::source::json::Projection::new(&["a", "b"]);
        let (mut out, mut framed) = (Vec::new(), 0);
        while out.len() < stop_after {
            let mut taken = Vec::new();
            let run = most.min((stop_after - out.len()) as u64);
            let got = src
                .next_records_framed(run, |ahead, pos, most, took| {
                    // As the job does: records one after another while the scan takes
                    // them, up to `most`, each at the position after the last.
                    let mut slots = [None; 2];
                    while took.records < most {
                        let Some(n) = p.scan_framed(&ahead[took.bytes..], &mut slots) else { break };
                        let at = took.bytes;
                        let record = String::from_utf8(ahead[at..at + n].to_vec()).unwrap();
                        let line = pos.line + took.records;
                        taken.push((record, Position { line, offset: pos.offset + at as u64, ..pos }));
                        took.records += 1;
                        took.bytes = at + n + crate::source::line_break_at(ahead, at + n).unwrap();
                    }
                    Ok(())
                })
                .unwrap();
            let ended = matches!(got, Framed::End);
            framed += taken.len();
            out.append(&mut taken);
            if let Framed::Record(r, pos) = got {
                // As the job does with a record found by its line break.
                let mut slots = [None; 2];
                let _ = p.scan(r, &mut slots);
                out.push((String::from_utf8(r.to_vec()).unwrap(), pos));
            }
            assert!(out.len() <= stop_after, "a call of at most {run} records gave more");
            // One file's end comes with the call that returns `End` (the job's loop stops
            // there on a bounded input), not with the records before it.
            assert!(ended || src.parts.len() > 1 || src.ended.is_empty(), "an end reported with records");
            if ended {
                break;
            }
        }
        (out, framed)
    }

    #[test]
    fn records_taken_where_they_lie_are_the_records_and_positions_of_the_lines() {
        // Reference: the same files read line by line (`next_record`, whose positions the
        // test above checks by hand), mapped and read with `read()`.
        let dir = tempfile::tempdir().unwrap();
        let mut one = String::new();
        let mut two = String::new();
        // Longer than a `read()` chunk: records cross from one chunk to the next.
        for i in 0..12_000 {
            one.push_str(&format!("{{\"a\": {i}, \"b\": \"x{i}\"}}\n"));
            if i >= 500 {
                continue;
            }
            match i % 50 {
                7 => two.push_str("{\"a\": 1, \"b\": \"broken\nline\"}\n"),
                8 => two.push_str("{\"a\": 2, \"b\": \"crlf\"}\r\n"),
                9 => two.push_str("\n   \n"),
                10 => two.push_str("not json\n"),
                _ => two.push_str(&format!("{{\"b\": \"y\", \"a\": {i}}}\n")),
            }
        }
        two.push_str("{\"b\": \"last\", \"a\": 0}");
        let paths = [dir.path().join("one.jsonl"), dir.path().join("two.jsonl")];
        std::fs::write(&paths[0], &one).unwrap();
        std::fs::write(&paths[1], &two).unwrap();
        // Both files (round robin: a record a call), and each alone (runs of records, cut
        // where the scan declines one: a line break in a string, `\r\n`, blank lines).
        for (files, min_framed) in [(&paths[..], 12_000), (&paths[..1], 11_990), (&paths[1..], 400)] {
            for (map, most) in [true, false].into_iter().flat_map(|m| [1, 5, 1024].map(|n| (m, n))) {
                let case = format!("{} files, mapped: {map}, runs of {most}", files.len());
                let mut lines = FileSource::open_parts(files, false, map, None).unwrap();
                let expected = collect(&mut lines);
                let mut framed_src = FileSource::open_parts(files, false, map, None).unwrap();
                let (got, framed) = collect_framed(&mut framed_src, usize::MAX, most);
                assert_eq!(got, expected, "{case}");
                assert!(one.len() > CHUNK && framed > min_framed, "{case}: {framed} framed");
                assert_eq!(framed_src.records(), lines.records(), "{case}");
                assert_eq!(framed_src.position().partitions, lines.position().partitions, "{case}");
                assert_eq!(framed_src.take_ended(), lines.take_ended(), "{case}");

                // Stopped part-way, the position resumes at the next record.
                let mut part = FileSource::open_parts(files, false, map, None).unwrap();
                let (head, _) = collect_framed(&mut part, 333, most);
                assert_eq!(part.records(), 333, "{case}");
                let mut resumed = FileSource::open_parts(files, false, map, Some(&part.position())).unwrap();
                let tail = collect(&mut resumed);
                assert_eq!([head, tail].concat(), expected, "{case}");
            }
        }
    }

    #[test]
    fn files_are_read_round_robin_and_report_their_end() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.jsonl");
        let b = dir.path().join("b.jsonl");
        std::fs::write(&a, "a1\na2\na3\n").unwrap();
        std::fs::write(&b, "b1\n").unwrap();
        let mut src = FileSource::open(&[a, b], None).unwrap();
        let mut seen = Vec::new();
        let mut ended = Vec::new();
        while let Some((r, p)) = src.next_record().unwrap() {
            seen.push((String::from_utf8(r.to_vec()).unwrap(), p.partition));
            ended.extend(src.take_ended());
        }
        ended.extend(src.take_ended());
        let want = [("a1", 0), ("b1", 1), ("a2", 0), ("a3", 0)];
        assert_eq!(seen, want.map(|(s, p)| (s.to_string(), p)));
        assert_eq!(ended, vec![1, 0]);
        assert_eq!(src.records(), 4);
    }

    #[test]
    fn a_followed_file_is_read_as_it_grows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("live.jsonl");
        std::fs::write(&path, "a\nb").unwrap();
        let mut src = FileSource::open_with(std::slice::from_ref(&path), true, None).unwrap();
        assert_eq!(src.next_record().unwrap().map(|(r, _)| r.to_vec()), Some(b"a".to_vec()));
        // "b" has no newline yet: not a complete record.
        assert!(src.next_record().unwrap().is_none());
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"c\nd\n").unwrap();
        assert_eq!(src.next_record().unwrap().map(|(r, _)| r.to_vec()), Some(b"bc".to_vec()));
        assert_eq!(src.next_record().unwrap().map(|(r, _)| r.to_vec()), Some(b"d".to_vec()));
        assert!(src.next_record().unwrap().is_none());
        assert!(src.take_ended().is_empty());
        assert_eq!(src.position().partitions[0].offset, 7);
    }

    #[test]
    fn lines_longer_than_a_chunk() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.jsonl");
        let long = format!("{{\"s\":\"{}\"}}", "x".repeat(CHUNK + 10));
        std::fs::write(&path, format!("{long}\n{{\"a\":1}}\n")).unwrap();
        // Mapped, and read in chunks (the buffer grows for the long line).
        for map in [true, false] {
            let mut src = FileSource::open_parts(std::slice::from_ref(&path), false, map, None).unwrap();
            assert_eq!(src.parts[0].map.is_some(), map);
            let all = collect(&mut src);
            assert_eq!(all.len(), 2);
            assert_eq!(all[0].0.len(), long.len());
            assert_eq!(all[1].1.offset, long.len() as u64 + 1);
        }
    }

    #[test]
    fn mapped_and_read_files_give_the_same_records_and_positions() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.jsonl");
        // Lines across many chunks and pages, blank lines, CRLF, no final newline.
        let mut text = String::new();
        for i in 0..40_000 {
            text.push_str(&format!("{{\"i\":{i},\"pad\":\"{}\"}}", "p".repeat(i % 97)));
            text.push_str(if i % 7 == 0 { "\r\n\n" } else { "\n" });
        }
        text.push_str("{\"last\":true}");
        std::fs::write(&path, &text).unwrap();
        let read = |map: bool, resume: Option<&SourcePosition>| {
            let mut src = FileSource::open_parts(std::slice::from_ref(&path), false, map, resume).unwrap();
            assert_eq!(src.parts[0].map.is_some(), map);
            collect(&mut src)
        };
        let (mapped, copied) = (read(true, None), read(false, None));
        assert_eq!(mapped.len(), 40_001);
        assert_eq!(mapped, copied);
        // Resumed in the middle, both ways.
        let mut src = FileSource::open_parts(std::slice::from_ref(&path), false, true, None).unwrap();
        for _ in 0..25_000 {
            src.next_record().unwrap();
        }
        let pos = src.position();
        assert_eq!(read(true, Some(&pos)), mapped[25_000..]);
        assert_eq!(read(false, Some(&pos)), mapped[25_000..]);
    }

    /// Another process truncating a mapped input would kill a plain mmap reader with
    /// SIGBUS; here the read fails with an error that says what happened.
    #[test]
    fn a_mapped_file_that_shrinks_while_read_is_an_error_not_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let line = format!("{{\"pad\":\"{}\"}}\n", "x".repeat(90));
        let write = |name: &str, lines: usize| {
            let path = dir.path().join(name);
            std::fs::write(&path, line.repeat(lines)).unwrap();
            path
        };
        let expect_shrank = |src: &mut FileSource| loop {
            match src.next_record() {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the input ended as if nothing happened"),
                Err(e) => {
                    assert!(e.to_string().contains("shrank while it was read"), "{e}");
                    break;
                }
            }
        };
        // Cut far below the reader: the pages it reads next are gone (SIGBUS, caught).
        let far = write("far.jsonl", 100_000);
        let mut src = FileSource::open(std::slice::from_ref(&far), None).unwrap();
        assert!(src.parts[0].map.is_some());
        for _ in 0..10 {
            src.next_record().unwrap();
        }
        std::fs::OpenOptions::new().write(true).open(&far).unwrap().set_len(5_000).unwrap();
        expect_shrank(&mut src);
        // Cut inside the last page: no fault, zeros past the cut; the length tells.
        let near = write("near.jsonl", 30);
        let mut src = FileSource::open(std::slice::from_ref(&near), None).unwrap();
        assert!(src.parts[0].map.is_some());
        src.next_record().unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&near)
            .unwrap()
            .set_len(line.len() as u64 * 20 + 7)
            .unwrap();
        // A checkpoint asks first, before it keeps a position.
        assert!(src.check_intact().is_err());
        expect_shrank(&mut src);
    }

    /// A file appended to after it was mapped (not followed) is read to the end it has
    /// when the reader gets there, as with `read()`: the rest of a line half written when
    /// it was mapped, then the new lines.
    #[test]
    fn a_mapped_file_that_grows_is_read_on_to_its_new_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("growing.jsonl");
        std::fs::write(&path, "a\nb\nha").unwrap();
        let mut src = FileSource::open(std::slice::from_ref(&path), None).unwrap();
        assert!(src.parts[0].map.is_some());
        assert_eq!(src.next_record().unwrap().map(|(r, p)| (r.to_vec(), p.offset)), Some((b"a".to_vec(), 0)));
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"lf\nc\n").unwrap();
        assert!(src.check_intact().is_ok());
        let rest = collect(&mut src);
        let texts: Vec<&str> = rest.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(texts, ["b", "half", "c"]);
        assert_eq!(rest[1].1, Position { partition: 0, line: 3, offset: 4 });
        assert_eq!(src.position().partitions[0].offset, 11);
    }
}
