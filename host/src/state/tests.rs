//! The state's parts together: keys, slots, captures.

#[test]
fn held_bytes_follow_the_accumulators_and_keys_written_and_removed() {
    let (mut keys, mut state) = (super::KeyTable::default(), super::WindowState::default());
    let w = crate::time::Window { start: 0, end: 5 };
    let k = keys.intern(b"\x01\x00\x00\x00a");
    state.open(k, 0, w);
    state.open(k, 5, w);
    state.set_acc(k, 0, b"12345");
    state.set_acc(k, 5, b"123");
    state.set_acc(k, 0, b"12");
    assert_eq!((state.acc_bytes(), keys.bytes()), (2 + 3, 5));
    state.remove(k, 5);
    assert_eq!(state.acc_bytes(), 2);
    state.replace_accs(|| &b"1234"[..]);
    assert_eq!(state.acc_bytes(), 4);
    keys.remove(k);
    assert_eq!(keys.bytes(), 0);
}

use super::*;

/// What a capture holds, by (key, slot id): (window start, accumulator).
fn held(c: &captured::CapturedSlots) -> BTreeMap<(Vec<u8>, i64), (i64, Vec<u8>)> {
    let all: Vec<_> = c.iter().map(|(k, id, w, acc)| ((k.to_vec(), id), (w.start, acc.to_vec()))).collect();
    assert_eq!(all.len() as u64, c.len());
    let map: BTreeMap<_, _> = all.into_iter().collect();
    assert_eq!(map.len() as u64, c.len(), "a slot taken twice");
    map
}

/// A whole capture holds every open slot, an incremental one the slots opened or
/// written since the previous incremental capture (whole ones in between or not),
/// each as it was when taken, through the writes, removals and compactions of the
/// slab after it: checked against a map of the slots and a set of those written.
#[test]
fn captures_hold_the_slots_open_or_written_when_taken() {
    for mut state in [WindowState::default(), WindowState::by_period()] {
        let mut keys = KeyTable::default();
        let key_of = |k: u64| {
            let mut e = Vec::new();
            push_key_field(&mut e, format!("k{k}").as_bytes());
            e
        };
        let mut open: BTreeMap<(Vec<u8>, i64), (i64, Vec<u8>)> = BTreeMap::new();
        let mut written: std::collections::BTreeSet<(Vec<u8>, i64)> = Default::default();
        let mut taken = Vec::new();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut compactions = 0;
        for step in 0..30_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let (k, id) = (key_of(x >> 40 & 511), (x >> 20 & 7) as i64 * 300);
            let kid = keys.intern(&k);
            let acc = step.to_le_bytes()[..(x >> 8) as usize % 9].to_vec();
            match x % 100 {
                0..=39 => {
                    let w = Window { start: id, end: id + 300 + (x & 1) as i64 };
                    let before = state.slab.len();
                    if state.open(kid, id, w) {
                        compactions += usize::from(state.slab.len() <= before);
                        open.insert((k.clone(), id), (id, Vec::new()));
                        written.insert((k, id));
                    }
                }
                40..=64 if state.handle(kid, id).is_some() => {
                    state.set_acc(kid, id, &acc);
                    open.get_mut(&(k.clone(), id)).unwrap().1 = acc;
                    written.insert((k, id));
                }
                65..=66 if state.handle(kid, id).is_some() => {
                    let start = id - 1 - (x >> 50) as i64 % 5;
                    state.set_window(kid, id, Window { start, end: id + 300 });
                    open.get_mut(&(k.clone(), id)).unwrap().0 = start;
                    written.insert((k, id));
                }
                97 if x >> 30 & 15 == 0 => {
                    // Every slot counts as written; every accumulator replaced (in the
                    // state's order: one value for all, so the order does not matter).
                    if x >> 34 & 1 == 0 {
                        state.touch_all();
                    } else {
                        state.replace_accs(|| &b"r"[..]);
                        open.values_mut().for_each(|(_, acc)| *acc = b"r".to_vec());
                    }
                    written.extend(open.keys().cloned());
                }
                67..=97 => {
                    assert_eq!(state.remove(kid, id).is_some(), open.remove(&(k.clone(), id)).is_some());
                    written.remove(&(k, id));
                }
                98 => taken.push((state.capture(&keys, false), open.clone())),
                99 => {
                    let want = open
                        .iter()
                        .filter(|(s, _)| written.contains(*s))
                        .map(|(s, v)| (s.clone(), v.clone()));
                    taken.push((state.capture(&keys, true), want.collect()));
                    written.clear();
                }
                _ => {}
            }
        }
        assert!(taken.len() > 500 && compactions > 0, "{} captures, {compactions} compactions", taken.len());
        for (i, (capture, want)) in taken.iter().enumerate() {
            assert_eq!(&held(capture), want, "capture {i}");
        }
    }
}

#[test]
fn slots_timers_and_key_counts() {
    let mut s = WindowState::default();
    let w = Window { start: 0, end: 5 };
    assert!(s.open(2, 0, w));
    assert!(!s.open(2, 0, w));
    assert!(s.open(2, 5, Window { start: 5, end: 10 }));
    s.set_acc(2, 0, b"a");
    assert_eq!(s.acc(2, 0), b"a");
    s.add_timer(Timer { time: 10, kind: TimerKind::Fire, key: 2, id: 5 });
    s.add_timer(Timer { time: 5, kind: TimerKind::Cleanup, key: 2, id: 0 });
    s.add_timer(Timer { time: 5, kind: TimerKind::Fire, key: 2, id: 0 });
    assert_eq!(s.next_timer(), Some(5));
    assert_eq!(s.pop_due(4), None);
    assert_eq!(s.pop_due(5).map(|t| t.kind), Some(TimerKind::Fire));
    assert_eq!(s.pop_due(5).map(|t| t.kind), Some(TimerKind::Cleanup));
    assert_eq!(s.pop_due(5), None);
    assert_eq!(s.remove(2, 0).map(|(_, last)| last), Some(false));
    assert_eq!(s.remove(2, 5).map(|(_, last)| last), Some(true));
    assert!(s.is_empty());
    assert_eq!(s.keys_in_use(), 0);
}
