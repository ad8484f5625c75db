//! Giving memory back after a flood: the core's maps and queues keep twice what they hold
//! (room to grow back without reallocating) once they are at most a quarter full, never less
//! than a floor.

use std::collections::VecDeque;

/// Map capacity kept however empty a map gets.
const SHRINK_FLOOR: usize = 64;

/// Gives back most of a map's capacity once it is at most a quarter full.
pub(crate) fn shrink_map<K: Eq + std::hash::Hash, V, S: std::hash::BuildHasher>(
    map: &mut std::collections::HashMap<K, V, S>,
) {
    let cap = map.capacity();
    if cap > SHRINK_FLOOR && map.len() <= cap / 4 {
        map.shrink_to((map.len() * 2).max(SHRINK_FLOOR));
    }
}

pub(crate) fn shrink_set<K: Eq + std::hash::Hash, S: std::hash::BuildHasher>(
    set: &mut std::collections::HashSet<K, S>,
) {
    let cap = set.capacity();
    if cap > SHRINK_FLOOR && set.len() <= cap / 4 {
        set.shrink_to((set.len() * 2).max(SHRINK_FLOOR));
    }
}

pub(crate) fn shrink_deque<T>(deque: &mut VecDeque<T>) {
    let cap = deque.capacity();
    if cap > SHRINK_FLOOR && deque.len() <= cap / 4 {
        deque.shrink_to((deque.len() * 2).max(SHRINK_FLOOR));
    }
}
