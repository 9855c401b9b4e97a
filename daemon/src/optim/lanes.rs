//! The slices an element-wise update ([`super::elementwise::Rule`]) runs over: the parameters it
//! reads and where it writes the new ones ([`Params`]: a slice in place, or [`ReadInto`]), and
//! what it stores ([`Write`]). Each rule's loop runs over them zipped together, with nothing chosen
//! per element, so that the compiler vectorizes it.

/// What an update stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Write {
    /// The parameters and the state.
    Both,
    /// The new parameters only (where the update's [`Params`] puts them).
    Params,
    /// The state only.
    State,
}

/// The parameter values an update reads, and where it puts the new ones: a slice, read and
/// written in place, or [`ReadInto`].
pub(crate) trait Params {
    /// How many values.
    fn len(&self) -> usize;
    /// Runs `f` on every element, (parameter, gradient, its two state values) to (new parameter,
    /// new state values), and stores what `write` says: one loop over the slices together, which
    /// the compiler can vectorize (a rule of two state slices, Adam's).
    fn each2(&mut self, lanes: Lanes2<'_>, write: Write, f: impl Fn(f32, f32, f32, f32) -> Step2);
    /// The same for a rule of three state slices (RMSprop's, centered and with momentum):
    /// (parameter, gradient, the three state values) to (new parameter, new state values).
    fn each3(&mut self, lanes: Lanes3<'_>, write: Write, f: impl Fn(f32, f32, [f32; 3]) -> Step3);
    /// The same for a rule of one state slice `a` (SGD's momentum): (parameter, gradient, state
    /// value) to (new parameter, new state value).
    fn each1(&mut self, g: &[f32], a: &mut [f32], write: Write, f: impl Fn(f32, f32, f32) -> (f32, f32));
    /// The same for a rule without state: (parameter, gradient) to the new parameter, written.
    fn each0(&mut self, g: &[f32], f: impl Fn(f32, f32) -> f32);
}

/// A new parameter value and two new state values.
pub(crate) type Step2 = (f32, f32, f32);

/// A new parameter value and three new state values.
pub(crate) type Step3 = (f32, [f32; 3]);

/// The slices a rule of three state slices runs over: the gradient and the state slices.
pub(crate) struct Lanes3<'s> {
    pub(crate) g: &'s [f32],
    pub(crate) state: [&'s mut [f32]; 3],
}

impl<'s> Lanes3<'s> {
    /// The gradient cut to `n` elements, and the state's three slices zipped, cut as well.
    #[allow(clippy::type_complexity)]
    fn cut(self, n: usize) -> (&'s [f32], impl Iterator<Item = ((&'s mut f32, &'s mut f32), &'s mut f32)>) {
        let [a, b, c] = self.state;
        (&self.g[..n], a[..n].iter_mut().zip(b[..n].iter_mut()).zip(c[..n].iter_mut()))
    }
}

/// The slices a rule of two state slices runs over: the gradient and the two state slices.
pub(crate) struct Lanes2<'s> {
    pub(crate) g: &'s [f32],
    pub(crate) a: &'s mut [f32],
    pub(crate) b: &'s mut [f32],
}

impl<'s> Lanes2<'s> {
    /// The slices cut to `n` elements each (so that the loops over them check no index).
    fn cut(self, n: usize) -> (&'s [f32], &'s mut [f32], &'s mut [f32]) {
        (&self.g[..n], &mut self.a[..n], &mut self.b[..n])
    }
}

/// [`Params::each2`] storing the state alone: the parameters `p` are only read.
#[inline]
fn store2(p: &[f32], lanes: Lanes2<'_>, f: impl Fn(f32, f32, f32, f32) -> Step2) {
    let (g, a, b) = lanes.cut(p.len());
    for (((&p, &g), a), b) in p.iter().zip(g).zip(a.iter_mut()).zip(b.iter_mut()) {
        (_, *a, *b) = f(p, g, *a, *b);
    }
}

/// [`Params::each3`] storing the state alone: the parameters `p` are only read.
#[inline]
fn store3<'s>(
    p: &[f32],
    g: &[f32],
    states: impl Iterator<Item = ((&'s mut f32, &'s mut f32), &'s mut f32)>,
    f: impl Fn(f32, f32, [f32; 3]) -> Step3,
) {
    for ((&p, &g), ((a, b), c)) in p.iter().zip(g).zip(states) {
        [*a, *b, *c] = f(p, g, [*a, *b, *c]).1;
    }
}

/// [`Params::each1`] storing the state alone: the parameters `p` are only read.
#[inline]
fn store1(p: &[f32], g: &[f32], a: &mut [f32], f: impl Fn(f32, f32, f32) -> (f32, f32)) {
    let (g, a) = (&g[..p.len()], &mut a[..p.len()]);
    for ((&p, &g), a) in p.iter().zip(g).zip(a.iter_mut()) {
        *a = f(p, g, *a).1;
    }
}

impl Params for [f32] {
    fn len(&self) -> usize {
        <[f32]>::len(self)
    }

    #[inline]
    fn each2(&mut self, lanes: Lanes2<'_>, write: Write, f: impl Fn(f32, f32, f32, f32) -> Step2) {
        let (g, a, b) = lanes.cut(self.len());
        match write {
            Write::Both => {
                for (((p, &g), a), b) in self.iter_mut().zip(g).zip(a.iter_mut()).zip(b.iter_mut()) {
                    (*p, *a, *b) = f(*p, g, *a, *b);
                }
            }
            Write::Params => {
                for (((p, &g), &a), &b) in self.iter_mut().zip(g).zip(a.iter()).zip(b.iter()) {
                    *p = f(*p, g, a, b).0;
                }
            }
            Write::State => store2(self, Lanes2 { g, a, b }, f),
        }
    }

    #[inline]
    fn each3(&mut self, lanes: Lanes3<'_>, write: Write, f: impl Fn(f32, f32, [f32; 3]) -> Step3) {
        let (g, states) = lanes.cut(self.len());
        match write {
            Write::Both => {
                for ((p, &g), ((a, b), c)) in self.iter_mut().zip(g).zip(states) {
                    (*p, [*a, *b, *c]) = f(*p, g, [*a, *b, *c]);
                }
            }
            Write::Params => {
                for ((p, &g), ((a, b), c)) in self.iter_mut().zip(g).zip(states) {
                    *p = f(*p, g, [*a, *b, *c]).0;
                }
            }
            Write::State => store3(self, g, states, f),
        }
    }

    #[inline]
    fn each1(&mut self, g: &[f32], a: &mut [f32], write: Write, f: impl Fn(f32, f32, f32) -> (f32, f32)) {
        let (g, a) = (&g[..self.len()], &mut a[..self.len()]);
        match write {
            Write::Both => {
                for ((p, &g), a) in self.iter_mut().zip(g).zip(a.iter_mut()) {
                    (*p, *a) = f(*p, g, *a);
                }
            }
            Write::Params => {
                for ((p, &g), &a) in self.iter_mut().zip(g).zip(a.iter()) {
                    *p = f(*p, g, a).0;
                }
            }
            Write::State => store1(self, g, a, f),
        }
    }

    #[inline]
    fn each0(&mut self, g: &[f32], f: impl Fn(f32, f32) -> f32) {
        let g = &g[..self.len()];
        for (p, &g) in self.iter_mut().zip(g) {
            *p = f(*p, g);
        }
    }
}

/// Parameter values read from one slice, borrowed where they lie (a sharded update reads them
/// from the parameter itself), with the new values written into another (the all-gather's
/// buffer), or nowhere when the update stores its state alone ([`Write::State`]).
pub(crate) struct ReadInto<'a> {
    from: &'a [f32],
    to: Option<&'a mut [f32]>,
}

impl<'a> ReadInto<'a> {
    /// Reads `from`, writes into `to` (as long), if given.
    pub(crate) fn new(from: &'a [f32], to: Option<&'a mut [f32]>) -> Self {
        assert!(to.as_ref().is_none_or(|to| to.len() == from.len()), "as many new values as read");
        ReadInto { from, to }
    }
}

impl Params for ReadInto<'_> {
    fn len(&self) -> usize {
        self.from.len()
    }

    #[inline]
    fn each2(&mut self, lanes: Lanes2<'_>, write: Write, f: impl Fn(f32, f32, f32, f32) -> Step2) {
        if write == Write::State {
            return store2(self.from, lanes, f);
        }
        let to = self.to.as_deref_mut().expect("an update that writes parameters has a place for them");
        let (g, a, b) = lanes.cut(self.from.len());
        let values = self.from.iter().zip(to.iter_mut()).zip(g);
        match write {
            Write::Params => {
                for (((&p, to), &g), (&a, &b)) in values.zip(a.iter().zip(b.iter())) {
                    *to = f(p, g, a, b).0;
                }
            }
            _ => {
                for (((&p, to), &g), (a, b)) in values.zip(a.iter_mut().zip(b.iter_mut())) {
                    (*to, *a, *b) = f(p, g, *a, *b);
                }
            }
        }
    }

    #[inline]
    fn each3(&mut self, lanes: Lanes3<'_>, write: Write, f: impl Fn(f32, f32, [f32; 3]) -> Step3) {
        let (g, states) = lanes.cut(self.from.len());
        if write == Write::State {
            return store3(self.from, g, states, f);
        }
        let to = self.to.as_deref_mut().expect("an update that writes parameters has a place for them");
        let values = self.from.iter().zip(to.iter_mut()).zip(g).zip(states);
        match write {
            Write::Params => {
                for (((&p, to), &g), ((a, b), c)) in values {
                    *to = f(p, g, [*a, *b, *c]).0;
                }
            }
            _ => {
                for (((&p, to), &g), ((a, b), c)) in values {
                    (*to, [*a, *b, *c]) = f(p, g, [*a, *b, *c]);
                }
            }
        }
    }

    #[inline]
    fn each1(&mut self, g: &[f32], a: &mut [f32], write: Write, f: impl Fn(f32, f32, f32) -> (f32, f32)) {
        if write == Write::State {
            return store1(self.from, g, a, f);
        }
        let to = self.to.as_deref_mut().expect("an update that writes parameters has a place for them");
        let n = self.from.len();
        let values = self.from.iter().zip(to.iter_mut()).zip(&g[..n]);
        match write {
            Write::Params => {
                for (((&p, to), &g), &a) in values.zip(&a[..n]) {
                    *to = f(p, g, a).0;
                }
            }
            _ => {
                for (((&p, to), &g), a) in values.zip(a[..n].iter_mut()) {
                    (*to, *a) = f(p, g, *a);
                }
            }
        }
    }

    #[inline]
    fn each0(&mut self, g: &[f32], f: impl Fn(f32, f32) -> f32) {
        let to = self.to.as_deref_mut().expect("an update that writes parameters has a place for them");
        for ((&p, to), &g) in self.from.iter().zip(to.iter_mut()).zip(&g[..self.from.len()]) {
            *to = f(p, g);
        }
    }
}
