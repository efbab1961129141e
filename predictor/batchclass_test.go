package predictor

import "testing"

// classTruth is a model at one row size whose batches of one run 1.3x the
// curve and batches of eight 1.0x, both times a load factor of the
// machine: a busy machine slows small batches more, relative to the
// curve, than large ones.
func classTruth(batch int, load float64) float64 {
	f := map[int]float64{1: 1.3, 4: 0.8, 8: 1.0}[batch]
	return flat.seconds(batch, 1, 0) * f * load
}

// observeClass runs one execution of a batch at load and returns the
// relative error of what was predicted for it.
func observeClass(p *Predictor, batch int, load float64) float64 {
	got, _ := p.EstimateSize("m", batch, 100)
	truth := classTruth(batch, load)
	p.ObserveSize("m", batch, 100, seconds(truth))
	return relErr(got.Seconds(), truth)
}

// The online correction is kept per (row size, batch class): batches of
// one and of eight at the same size, served in turn, are each predicted
// at their own error, where one correction for the size sits between the
// two and is off by about 14% for both. The sizes' correction still
// follows a change of the machine's load that all batches share at once,
// as one correction did: the classes' offsets hold only what sets them
// apart.
func TestCorrectionPerBatchClass(t *testing.T) {
	p := newPredictor(t, Options{})
	p.SetProfile("m", Profile{Curve: flat})
	for i := range 200 {
		observeClass(p, []int{1, 8}[i%2], 1)
	}
	for _, b := range []int{1, 8} {
		if e := observeClass(p, b, 1); e > 0.02 {
			t.Errorf("batch %d in turn with the other: error %.1f%%, want under 2%%", b, 100*e)
		}
	}
	// The machine gets 1.5x busier for every batch: within 30 executions
	// (15 of each) both are predicted within 3% again, as the size's
	// correction alone would be.
	var worst float64
	for i := range 60 {
		e := observeClass(p, []int{1, 8}[i%2], 1.5)
		if i >= 30 {
			worst = max(worst, e)
		}
	}
	if worst > 0.03 {
		t.Errorf("after a common step of the load: error up to %.1f%%, want under 3%%", 100*worst)
	}
}

// A model served at batch 1, then at batch 8 alone, then at batch 1 again
// does not learn each class's error again at each change: a class running
// alone keeps the offsets (its own and the others'), and the first
// executions after a change are predicted at their class's error. With
// one correction per size the first batch of 8 after the batch-1 stretch
// was predicted 30% slow.
func TestCorrectionBatchClassesInTurn(t *testing.T) {
	p := newPredictor(t, Options{})
	p.SetProfile("m", Profile{Curve: flat})
	// Both classes learnt first, in turn.
	for i := range 200 {
		observeClass(p, []int{1, 8}[i%2], 1)
	}
	for phase, b := range []int{1, 8, 1, 8} {
		for i := range 150 {
			if e := observeClass(p, b, 1); i < 3 && e > 0.03 {
				t.Errorf("stretch %d at batch %d: execution %d off by %.1f%%, want under 3%%", phase, b, i, 100*e)
			}
		}
	}
}

// A batch class seen fewer than minClassSamples times is predicted by its
// size's correction (the coarser one) and its first executions do not
// move the classes learnt before it; from then on it is predicted at its
// own offset.
func TestCorrectionNewBatchClassFallsBack(t *testing.T) {
	p := newPredictor(t, Options{})
	p.SetProfile("m", Profile{Curve: flat})
	for i := range 200 {
		observeClass(p, []int{1, 8}[i%2], 1)
	}
	m := p.get("m")
	size := func() float64 {
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.sizes[sizeBucket(100)].v
	}
	est := func(b int) float64 {
		d, _ := p.EstimateSize("m", b, 100)
		return d.Seconds()
	}
	before1, before8 := est(1), est(8)
	for i := range minClassSamples {
		if got, want := est(4), flat.seconds(4, 1, 0)*size(); relErr(got, want) > 1e-6 {
			t.Errorf("batch 4, execution %d: %.6fs, want the size's correction's %.6fs", i, got, want)
		}
		p.ObserveSize("m", 4, 100, seconds(classTruth(4, 1)))
	}
	if relErr(est(1), before1) > 1e-9 || relErr(est(8), before8) > 1e-9 {
		t.Errorf("batch 4's first executions moved batch 1 (%v to %v) or batch 8 (%v to %v)", before1, est(1), before8, est(8))
	}
	for i := range 60 {
		observeClass(p, []int{1, 4, 8}[i%3], 1)
	}
	for _, b := range []int{1, 4, 8} {
		if e := observeClass(p, b, 1); e > 0.03 {
			t.Errorf("batch %d after 20 executions of each: error %.1f%%, want under 3%%", b, 100*e)
		}
	}
}

// The batch classes are octaves.
func TestBatchClass(t *testing.T) {
	for b, want := range map[int]int{-1: 0, 0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 7: 2, 8: 3, 64: 6} {
		if got := batchClass(b); got != want {
			t.Errorf("batchClass(%d) = %d, want %d", b, got, want)
		}
	}
}
