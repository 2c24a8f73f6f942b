//! The bound on the per-row recurrent states one step keeps. A hybrid
//! target's verification keeps a whole recurrent state after every row
//! but the last (so the rows after a rejected draft roll back), each the
//! size of a state slot: ~465 MB for a full Kimi K3 at TP 1, so a handful
//! of drafted rows can exhaust a host. Every step's plan is fitted to
//! `[kv] row_state_mib` here before any forward: drafts and branches
//! shrink (never below a plain decode row, which keeps no extra state), so
//! no request holds more than the budget and the step as a whole neither.

/// Rows whose states a step may keep under `budget_bytes`, for states of
/// `state_bytes` each; `None` (unbounded) for a target without recurrent
/// state.
pub fn row_budget(budget_bytes: usize, state_bytes: usize) -> Option<usize> {
    (state_bytes > 0).then(|| budget_bytes / state_bytes)
}

/// Shrinks each sequence's planned chain drafts `ks[i]` and branch nodes
/// `widths[i]` until the rows that keep a state, `sum(ks[i] + widths[i])`,
/// are at most `rows`: one row at a time from the sequence that holds the
/// most, a branch before a chain draft (the chain's first guesses are the
/// likeliest kept), and no branch left without a chain to hang on.
/// Returns the rows given up.
///
/// # Panics
/// If `ks` and `widths` differ in length.
pub fn fit_rows(ks: &mut [usize], widths: &mut [usize], rows: usize) -> usize {
    assert_eq!(ks.len(), widths.len());
    let held = |ks: &[usize], ws: &[usize]| ks.iter().zip(ws).map(|(k, w)| k + w).sum::<usize>();
    let before = held(ks, widths);
    while held(ks, widths) > rows {
        // Some sequence holds a row (the sum is positive): the first of
        // those holding the most.
        let i = (0..ks.len())
            .max_by_key(|&i| (ks[i] + widths[i], std::cmp::Reverse(i)))
            .expect("a row is held");
        if widths[i] > 0 {
            widths[i] -= 1;
        } else {
            ks[i] -= 1;
        }
        if ks[i] == 0 {
            widths[i] = 0;
        }
    }
    before - held(ks, widths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_is_whole_states_and_none_without_recurrence() {
        assert_eq!(row_budget(1 << 30, 465 << 20), Some(2));
        assert_eq!(row_budget(100, 200), Some(0));
        assert_eq!(row_budget(1 << 30, 0), None);
    }

    #[test]
    fn fitting_takes_from_the_largest_branches_first_and_keeps_what_fits() {
        let (mut ks, mut ws) = (vec![3, 1, 0], vec![2, 0, 0]);
        assert_eq!(fit_rows(&mut ks, &mut ws, 10), 0);
        assert_eq!((ks.clone(), ws.clone()), (vec![3, 1, 0], vec![2, 0, 0]));
        assert_eq!(fit_rows(&mut ks, &mut ws, 3), 3);
        assert_eq!((ks.clone(), ws.clone()), (vec![2, 1, 0], vec![0, 0, 0]));
        assert_eq!(fit_rows(&mut ks, &mut ws, 0), 3);
        assert_eq!((ks, ws), (vec![0, 0, 0], vec![0, 0, 0]));
    }

    #[test]
    fn a_chain_cut_to_nothing_takes_its_branches_with_it() {
        let (mut ks, mut ws) = (vec![1, 4], vec![3, 0]);
        // 8 rows into 4: the 4-draft chain and the 1 + 3 tree shrink alike.
        fit_rows(&mut ks, &mut ws, 4);
        let held: usize = ks.iter().zip(&ws).map(|(k, w)| k + w).sum();
        assert!(held <= 4);
        assert!(ks.iter().zip(&ws).all(|(&k, &w)| k > 0 || w == 0));
    }
}
