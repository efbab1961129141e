package predictor

import (
	"math"
	"math/bits"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Estimator is the method set the QoS scheduler needs (qos.Estimator has
// the same one; this package does not import qos so that qos may import
// it). Implementations must be safe for concurrent use.
type Estimator interface {
	Estimate(model string, batch int) (time.Duration, bool)
	Observe(model string, batch int, took time.Duration)
}

// SizedEstimator is an Estimator that also takes the size of a batch's
// rows: the elements of one row of its input (Point.Elements). The QoS
// scheduler passes each request's own size to one (qos.SizedEstimator has
// the same method set).
type SizedEstimator interface {
	Estimator
	EstimateSize(model string, batch int, elements int64) (time.Duration, bool)
	ObserveSize(model string, batch int, elements int64, took time.Duration)
}

var (
	_ SizedEstimator = (*Predictor)(nil)
	_ Estimator      = (*batchEWMA)(nil)
)

// Defaults of Options.
const (
	DefaultAlpha  = 0.1
	DefaultSeason = 24 * time.Hour
	// Window is how many recent executions Accuracy averages over.
	Window = 100
)

// Bounds of the online correction and the interference factor. One
// execution's observed/predicted ratio is clamped to within stepRatio of
// the correction in force, so that one outlier cannot swing it while a
// persistent error (a model served at inputs ten times the profiled size)
// is still learned within tens of executions; the correction itself stays
// in [minCorrection, maxCorrection]. Outside [1/driftRatio, driftRatio]
// the profile no longer describes what the model serves: Accuracy.Drift
// says so (and the metric sloserve_predictor_drift), so that an operator
// profiles at the served shapes (the model config's profile.shapes).
//
// Corrections are kept per row size and, relative to it, per (row size,
// batch class) (predictions use both, see correctionAt), and per bucket
// (see bucket; at most maxBuckets a model; they raise the drift alarms).
const (
	stepRatio       = 4
	minCorrection   = 1.0 / 64
	maxCorrection   = 64
	driftRatio      = 2.0 // a float: 1/driftRatio must not be integer division
	maxInterference = 4
	maxBuckets      = 4096
	// minBucketSamples is how many executions a bucket must have seen
	// before its correction can raise a drift alarm.
	minBucketSamples = 10
	// freshExecutions is how recent a bucket's latest execution must be
	// (in the model's executions) for its correction to be used.
	freshExecutions = Window
	// typicalWeight is the weight of a new execution's row size in the
	// model's typical size, which predictions of unknown size use.
	typicalWeight = 0.05
	// minClassSamples is how many executions a (row size, batch class)
	// must have seen before its offset from the size's correction is
	// used; until then the size's correction predicts it alone.
	minClassSamples = 5
)

// batchClass is a batch size's class for the online correction: its
// octave (1, 2-3, 4-7, 8-15, ...). A busy machine slows a batch of one
// more, relative to the curve, than a batch of eight (the fixed costs of
// an execution wait for the CPU as its work does, and are a larger part
// of a small batch), and the fit's error differs by batch too.
func batchClass(batch int) int {
	return bits.Len(uint(max(batch, 1))) - 1
}

// bucket is where an online correction applies: a half-octave of the row
// size (round(2*log2(elements)); -1 unknown), the batch size, and the
// share in steps of 1/20. Within a bucket the curve's error is about one
// factor; across shapes it is not, and one correction for all of a model's
// shapes relearns each time the shape changes.
type bucket struct {
	size, batch, share int
}

func sizeBucket(elements int64) int {
	if elements <= 0 {
		return -1
	}
	return int(math.Round(2 * math.Log2(float64(elements))))
}

func newBucket(batch int, share float64, elements int64) bucket {
	return bucket{size: sizeBucket(elements), batch: max(batch, 1), share: int(math.Round(normShare(share) * 20))}
}

// Drift is a drift alarm: a bucket's online correction moved outside
// [1/2, 2], so the profile no longer describes executions of that shape,
// batch and share.
type Drift struct {
	Model      string
	Elements   int64 // the row size of the execution that raised it; 0 unknown
	Batch      int
	Share      float64
	Correction float64
}

// Options configure a Predictor.
type Options struct {
	// Alpha is the weight of a new observed/predicted ratio in the online
	// correction, in (0, 1]; default DefaultAlpha.
	Alpha float64
	// Fallback estimates a model that has no curve yet, from the
	// executions Observe reports. Nil means a built-in EWMA per batch size
	// (weight 0.2). A *qos.EWMAEstimator fits here; Forget cannot clear
	// a given fallback's memory of a model.
	Fallback Estimator
	// Season is the period of the arrival-rate seasonality, default
	// DefaultSeason; negative disables seasonality.
	Season time.Duration
	// Registerer receives the predictor's metrics; nil means none.
	Registerer prometheus.Registerer
	// Device is the const label "device" on the metrics; empty means none.
	Device string
	// OnDrift, when set, is called (outside the predictor's locks) each
	// time a bucket's correction moves into drift; it must not block.
	OnDrift func(Drift)
}

// Predictor predicts each model's execution time from its fitted curve,
// the share it runs at, an online correction and an interference factor,
// and forecasts each model's arrival rate. It implements the QoS
// scheduler's Estimator (Estimate and Observe at the model's current
// share). Model keys are strings such as "ocr-det/1". Safe for concurrent
// use.
type Predictor struct {
	alpha    float64
	season   time.Duration
	fallback Estimator
	forget   func(model string) // the built-in fallback's; nil for a given one
	onDrift  func(Drift)

	mu     sync.RWMutex
	models map[string]*model
}

// model is one model's state, guarded by its own mutex so that models do
// not contend.
type model struct {
	mu          sync.Mutex
	curve       Curve
	hasCurve    bool
	knees       knees // where the profile stopped getting faster
	memory      workingSets
	profileMAPE float64
	share       float64 // normalised, (0, 1]
	othersUtil  float64
	co          coRun       // the slowdown by co-running work, learned (corun.go)
	correction  float64     // the model's, over all buckets
	period      periodStart // the model's correction at the latest SetCoRunning
	buckets     map[bucket]*bucketCorrection
	sizes       map[int]*bucketCorrection // per size bucket, over batches and shares
	typical     float64                   // EWMA of the observed row sizes; 0 none
	alarms      uint64                    // drift alarms raised
	seq         uint64                    // executions observed with a curve
	recent      [Window]pair
	next, n     int
	rate        *rateModel
	busy        float64 // seconds of execution observed, cumulative
}

// bucketCorrection is one size's or one bucket's online correction; drift
// is whether the bucket's correction in force is out of bounds.
type bucketCorrection struct {
	v      float64
	n      int    // executions seen
	last   uint64 // model.seq at the latest
	drift  bool
	period periodStart // sizes only
	// classes are a size's batch classes' offsets from its correction,
	// indexed by batchClass; sizes only (see learnSize).
	classes []classOffset
}

// classOffset is a batch class's offset from its size's correction, with
// the executions it saw and the latest (model.seq).
type classOffset struct {
	v    float64
	n    int
	last uint64
}

// periodStart is a correction's value at the latest SetCoRunning and the
// executions that moved it since.
type periodStart struct {
	v float64
	n int
}

// pair is one execution: its bucket, what was predicted for it and what it
// took, in seconds.
type pair struct {
	key                 bucket
	predicted, observed float64
}

// New returns a Predictor.
func New(opts Options) (*Predictor, error) {
	p := &Predictor{
		alpha:    opts.Alpha,
		season:   opts.Season,
		fallback: opts.Fallback,
		onDrift:  opts.OnDrift,
		models:   map[string]*model{},
	}
	if !(p.alpha > 0 && p.alpha <= 1) {
		p.alpha = DefaultAlpha
	}
	if p.season == 0 {
		p.season = DefaultSeason
	}
	if p.fallback == nil {
		e := newBatchEWMA(0.2)
		p.fallback, p.forget = e, e.forget
	}
	if opts.Registerer != nil {
		if err := registerCollector(opts.Registerer, newCollector(p, opts.Device)); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// get returns a model's state or nil.
func (p *Predictor) get(name string) *model {
	p.mu.RLock()
	m := p.models[name]
	p.mu.RUnlock()
	return m
}

// ensure returns a model's state, creating it.
func (p *Predictor) ensure(name string) *model {
	if m := p.get(name); m != nil {
		return m
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	m := p.models[name]
	if m == nil {
		m = &model{share: 1, correction: 1, period: periodStart{v: 1}, rate: newRateModel(p.season)}
		p.models[name] = m
	}
	return m
}

// SetProfile installs a model's fitted curve and resets its online
// correction. A profile whose curve is unusable (zero, negative or not
// finite coefficients) is fitted again from its points; if that fails too
// the model keeps what it had.
func (p *Predictor) SetProfile(name string, prof Profile) {
	c, pm := prof.Curve, prof.MAPE
	if !c.valid() {
		var err error
		if c, err = Fit(prof.Points); err != nil {
			return
		}
		pm = MAPE(c, prof.Points)
	}
	if !(pm > 0) || math.IsInf(pm, 0) {
		pm = MAPE(c, prof.Points)
	}
	m := p.ensure(name)
	m.mu.Lock()
	m.curve, m.hasCurve, m.profileMAPE, m.correction = c, true, pm, 1
	m.period = periodStart{v: 1}
	m.buckets, m.sizes = nil, nil
	m.co.reset()
	m.knees = findKnees(prof.Points)
	m.memory = findWorkingSets(prof.Points)
	m.mu.Unlock()
}

// Forget drops everything known about a model (it was unloaded), its
// metric series included. A later call about it starts afresh.
func (p *Predictor) Forget(name string) {
	p.mu.Lock()
	delete(p.models, name)
	p.mu.Unlock()
	if p.forget != nil {
		p.forget(name)
	}
}

// SetShare sets the share the model runs at now; 0, a share of 1 or more,
// or NaN mean the whole device.
func (p *Predictor) SetShare(name string, share float64) {
	m := p.ensure(name)
	m.mu.Lock()
	m.share = normShare(share)
	m.mu.Unlock()
}

// SetInterference sets how much of the device the models co-located with
// this one use, as a fraction of the device (0..n; negative or NaN count as
// 0). Predictions are multiplied by the interference factor
//
//	f(s) = min(max(s + othersUtil, 1), 4)
//
// for the model's share s: while the shares in use fit on the device the
// model runs as profiled, and when the device is oversubscribed everyone
// runs proportionally slower, by at most 4x.
func (p *Predictor) SetInterference(name string, othersUtil float64) {
	if !(othersUtil > 0) || math.IsInf(othersUtil, 0) {
		othersUtil = 0
	}
	m := p.ensure(name)
	m.mu.Lock()
	m.othersUtil = othersUtil
	m.mu.Unlock()
}

// SetCoRunning tells the predictor how much of a shared device (a GPU
// under MPS) the work co-running with the model used over the control
// period that just ended, as measured (per-process utilisation of the
// others, 0..1 of the device; negative or NaN count as 0). The
// executions observed since the previous call are taken to have run
// under it, and learn how much the model slows per unit of it (see
// coRun); predictions from now on are at the use it forecasts for the
// next period (coRun.forecast).
func (p *Predictor) SetCoRunning(name string, othersUtil float64) {
	if !(othersUtil > 0) || math.IsInf(othersUtil, 0) {
		othersUtil = 0
	}
	m := p.ensure(name)
	m.mu.Lock()
	defer m.mu.Unlock()
	was := m.co.factor()
	m.co.period(othersUtil)
	// The period's executions were compared with predictions at the use
	// forecast for it. What they taught the corrections (an EWMA of the
	// ratios' logarithms: scaling every ratio by r scales what they
	// taught by r to the power of their weight, 1-d) is rescaled as if
	// they had been compared at the use now forecast for the next
	// period, so that a change of the
	// co-runners' use is not counted twice, once by the correction and
	// again by the slowdown. (Rescaled to the use measured instead, the
	// corrections forget the step a correction alone would have kept,
	// and the forecast, which expects only part of a step to last, is
	// left to carry it: on server's TestSimulatedCoRunningEntersPrediction
	// the MAPE went from 3.4% to 4.5%, 5.3% without the use.)
	r := was / m.co.factor()
	redo := func(v *float64, ps *periodStart) {
		if r != 1 && ps.n > 0 {
			d := math.Pow(1-p.alpha, float64(ps.n))
			*v = min(max(*v*math.Pow(r, 1-d), minCorrection), maxCorrection)
		}
		*ps = periodStart{v: *v}
	}
	redo(&m.correction, &m.period)
	for _, sc := range m.sizes {
		redo(&sc.v, &sc.period)
	}
}

func interference(share, othersUtil float64) float64 {
	return min(max(share+othersUtil, 1), maxInterference)
}

// Latency predicts the execution time of a batch at a share (normalised as
// in SetShare) at the model's typical row size (the recent executions'
// mean; the curve's reference size before any): the curve's prediction
// times the online correction times the interference factor at that share,
// with the co-runners' slowdown at their mean use of the last periods
// rather than the next period's forecast: a share is chosen for longer
// than a period. (At the forecast, which moves each period, the adjuster's
// targets moved with it: on the simulated GPU day, server's
// TestSimulatedGPUDayAdaptive, seeds 18-20, 20/14/19 resizes and LC
// attainment 97.42/97.39/97.75%, against 10/13/17 and 97.83/97.85/97.78%
// without the co-runners' slowdown; at the mean use 17/16/13 and
// 97.99/97.83/97.41%.) A model without a curve answers from the fallback, whose observations
// were made at the current share; for another share it is scaled by
// current/share (time inversely proportional to the share). False means
// neither is known.
func (p *Predictor) Latency(name string, batch int, share float64) (time.Duration, bool) {
	m := p.get(name)
	if m == nil {
		return p.fallback.Estimate(name, batch)
	}
	s := normShare(share)
	m.mu.Lock()
	if m.hasCurve {
		n := int64(m.typical)
		v := m.solo(batch, s, n) * m.co.meanFactor() * m.correctionAt(newBucket(batch, s, n))
		m.mu.Unlock()
		return seconds(v), true
	}
	cur := m.share
	m.mu.Unlock()
	d, ok := p.fallback.Estimate(name, batch)
	if !ok || s == cur {
		return d, ok
	}
	return seconds(d.Seconds() * cur / s), true
}

// base is the curve's prediction with interference (the oversubscription
// factor and the co-runners' learned slowdown), without correction. The
// caller holds m.mu and has checked m.hasCurve.
func (m *model) base(batch int, share float64, elements int64) float64 {
	return m.solo(batch, share, elements) * m.co.factor()
}

// solo is base without the co-runners' learned slowdown.
func (m *model) solo(batch int, share float64, elements int64) float64 {
	return m.curve.seconds(batch, m.knees.clamp(batch, share), elements) * interference(share, m.othersUtil)
}

// correctionAt is the correction in force for a bucket: its size's
// (learnt from every execution at that size, so that a shape's persistent
// error is learnt as fast as one scalar learnt it) times its batch
// class's offset from it (see learnSize), or the model's when the size
// was not seen in the model's last freshExecutions executions (what it
// learnt, under the interference of then, is stale; the model's is
// current).
//
// The bucket's own correction (batch and share too) is kept, and raises
// the drift alarms, but does not predict: on the simulated GPU day
// (server's TestSimulatedGPUDayAdaptive) predicting from it took the
// latency-critical attainment from over 0.95 to 0.86, fresh buckets only
// or not. Much of what a correction learns is interference that changes
// by the second, and a bucket, fed a fraction of the executions, follows
// it later than a correction that every execution at the size feeds. The
// batch class's offset does not have that lag: the size's correction,
// which every execution at the size feeds, follows the interference, and
// the offset holds only how much more or less than that a class runs.
func (m *model) correctionAt(k bucket) float64 {
	if sc := m.sizes[k.size]; sc != nil && m.seq-sc.last < freshExecutions {
		return sc.v * sc.offset(batchClass(k.batch))
	}
	return m.correction
}

// offset is the offset in force for a batch class of a size: 1 (the
// size's correction alone) until the class has seen minClassSamples
// executions.
func (sc *bucketCorrection) offset(class int) float64 {
	if class < len(sc.classes) && sc.classes[class].n >= minClassSamples {
		return sc.classes[class].v
	}
	return 1
}

// learnSize moves a size's correction and its batch classes' offsets by
// an execution of batch class class whose time was r times the curve's.
// The size's correction times the class's offset models the error at
// the size as a part all its batches share (the machine's load of the
// moment, the size's own error) and a part that sets a class apart (a
// busy machine slows a batch of one more than a batch of eight, relative
// to the curve; the fit errs differently by batch). With e the
// execution's error, log(r) less the logarithm of the two:
//   - while the class is the only one of the size seen in the model's
//     last freshExecutions executions, or the only one of them with
//     minClassSamples executions, the size's correction learns e alone:
//     nothing tells a class apart from the others, and a model served
//     at one batch size learns as it did before classes;
//   - a class with fewer executions while others run learns e into its
//     own offset alone: its first executions do not move what the others
//     have learnt, and it is predicted by the size's correction until it
//     has minClassSamples;
//   - otherwise the size's correction learns e, and the class's offset
//     learns e times (1 - 1/K) and the K-1 other fresh classes' -e/K, K
//     the fresh classes with minClassSamples executions: the offsets'
//     product stays where it was, so what all classes share (a change of
//     the machine's load) goes to the size's correction, and what sets
//     one class apart to its offset.
//
// So a model served at batch 1 and 8 in turn, for long stretches each,
// does not learn the classes' difference again at each change: a class
// running alone keeps the offset it had, and one that comes back finds
// its own.
func (sc *bucketCorrection) learnSize(class int, r, alpha float64, seq uint64) {
	for len(sc.classes) <= class {
		sc.classes = append(sc.classes, classOffset{v: 1})
	}
	fresh := func(c classOffset) bool { return c.n > 0 && seq-c.last < freshExecutions }
	var others, ready int // other fresh classes; fresh classes with minClassSamples, this one included
	for j, c := range sc.classes {
		if j != class && fresh(c) {
			others++
		}
		if (j == class || fresh(c)) && c.n >= minClassSamples {
			ready++
		}
	}
	own := &sc.classes[class]
	learnt := own.n >= minClassSamples
	// e is the error on the logarithmic scale, bounded as one step of
	// the correction is (stepRatio).
	e := func(c float64) float64 {
		return min(max(math.Log(r/c), -math.Log(stepRatio)), math.Log(stepRatio))
	}
	clampC := func(v float64) float64 { return min(max(v, minCorrection), maxCorrection) }
	switch {
	case others == 0 || (learnt && ready == 1):
		sc.v = clampC(sc.v * math.Exp(alpha*e(sc.v*sc.offset(class))))
	case !learnt:
		own.v = clampC(own.v * math.Exp(alpha*e(sc.v*own.v)))
	default:
		d := alpha * e(sc.v*own.v)
		sc.v = clampC(sc.v * math.Exp(d))
		k := float64(ready)
		for j := range sc.classes {
			c := &sc.classes[j]
			switch {
			case j == class:
				c.v = clampC(c.v * math.Exp(d*(1-1/k)))
			case fresh(*c) && c.n >= minClassSamples:
				c.v = clampC(c.v * math.Exp(-d/k))
			}
		}
	}
	own.n++
	own.last = seq
}

// Estimate predicts the execution time of a batch at the model's current
// share and its typical row size. It implements qos.Estimator.
func (p *Predictor) Estimate(name string, batch int) (time.Duration, bool) {
	return p.EstimateSize(name, batch, 0)
}

// EstimateSize predicts the execution time of a batch whose rows have
// elements elements each (0: unknown, the model's typical size) at the
// model's current share, corrected by that bucket's online correction. It
// implements qos.SizedEstimator. Without a curve it answers from the
// fallback (size-aware when built in).
func (p *Predictor) EstimateSize(name string, batch int, elements int64) (time.Duration, bool) {
	m := p.get(name)
	if m == nil {
		return p.fallbackEstimate(name, batch, elements)
	}
	m.mu.Lock()
	if m.hasCurve {
		if elements <= 0 {
			elements = int64(m.typical)
		}
		v := m.base(batch, m.share, elements) * m.correctionAt(newBucket(batch, m.share, elements))
		m.mu.Unlock()
		return seconds(v), true
	}
	m.mu.Unlock()
	return p.fallbackEstimate(name, batch, elements)
}

func (p *Predictor) fallbackEstimate(name string, batch int, elements int64) (time.Duration, bool) {
	if f, ok := p.fallback.(*batchEWMA); ok {
		return f.estimateSize(name, batch, elements)
	}
	return p.fallback.Estimate(name, batch)
}

// Observe reports an execution of a batch of unknown row size at the
// model's current share; see ObserveSize.
func (p *Predictor) Observe(name string, batch int, took time.Duration) {
	p.ObserveSize(name, batch, 0, took)
}

// ObserveSize reports an execution of a batch whose rows have elements
// elements each (0 unknown) at the model's current share. It implements
// qos.SizedEstimator. With a curve, the ratio of the observed time to the
// curve's prediction (interference included, correction not), clamped to
// within 4x of the correction in force so that one outlier cannot swing
// it, feeds the EWMA of the execution's bucket, of its size bucket and
// its batch class's offset there (learnSize), and of the model. A bucket
// whose correction leaves [1/2, 2] raises a drift alarm (Options.OnDrift,
// Accuracy.DriftAlarms). Its ratio to the curve
// without the co-runners' slowdown joins the regression that learns that
// slowdown (SetCoRunning). The execution and what
// EstimateSize predicted for it join the recent window Accuracy reports
// on. The fallback sees every execution, so it is current should the
// curve be forgotten.
func (p *Predictor) ObserveSize(name string, batch int, elements int64, took time.Duration) {
	if batch < 1 || took <= 0 {
		return
	}
	obs := took.Seconds()
	m := p.ensure(name)
	m.mu.Lock()
	m.busy += obs
	if elements > 0 {
		if m.typical == 0 {
			m.typical = float64(elements)
		} else {
			m.typical += typicalWeight * (float64(elements) - m.typical)
		}
	}
	if m.hasCurve {
		n := elements
		if n <= 0 {
			n = int64(m.typical)
		}
		k := newBucket(batch, m.share, n)
		solo := m.solo(batch, m.share, n)
		base := solo * m.co.factor()
		m.co.observe(k.size, obs/solo)
		in := m.correctionAt(k)
		m.record(k, seconds(base*in).Seconds(), obs)
		// The EWMA runs on the ratios' logarithms: a stall that makes one
		// execution 4x slow moves the correction by the same factor as a
		// burst 4x fast, so the CPU stalls of a busy host (a right tail)
		// do not ratchet it up; the tail is the error quantile's to cover.
		step := func(c float64) float64 {
			ratio := min(max(obs/base, c/stepRatio), c*stepRatio)
			return min(max(math.Exp(p.alpha*math.Log(ratio)+(1-p.alpha)*math.Log(c)), minCorrection), maxCorrection)
		}
		// A size or a bucket seen for the first time starts from the
		// correction it was predicted with, and learns at the same pace.
		sc := m.sizes[k.size]
		if sc == nil {
			if m.sizes == nil {
				m.sizes = map[int]*bucketCorrection{}
			}
			sc = &bucketCorrection{v: in, period: periodStart{v: in}}
			m.sizes[k.size] = sc
		} else if m.seq-sc.last >= freshExecutions {
			// Stale: it starts again from the model's, which predicted.
			sc.v, sc.period = m.correction, periodStart{v: m.correction}
		}
		bc := m.buckets[k]
		if bc == nil && len(m.buckets) < maxBuckets {
			if m.buckets == nil {
				m.buckets = map[bucket]*bucketCorrection{}
			}
			bc = &bucketCorrection{v: in}
			m.buckets[k] = bc
		}
		m.seq++
		sc.learnSize(batchClass(k.batch), obs/base, p.alpha, m.seq)
		sc.n, sc.last = sc.n+1, m.seq
		m.correction = step(m.correction)
		sc.period.n++
		m.period.n++
		var alarm *Drift
		if bc != nil {
			bc.v, bc.n, bc.last = step(bc.v), bc.n+1, m.seq
			c := bc.v
			drift := bc.n >= minBucketSamples && (c > driftRatio || c < 1/driftRatio)
			if drift && !bc.drift {
				m.alarms++
				alarm = &Drift{Model: name, Elements: elements, Batch: batch, Share: m.share, Correction: c}
			}
			bc.drift = drift
		}
		m.mu.Unlock()
		if alarm != nil && p.onDrift != nil {
			p.onDrift(*alarm)
		}
	} else {
		m.mu.Unlock()
		if d, ok := p.fallbackEstimate(name, batch, elements); ok {
			m.mu.Lock()
			m.record(newBucket(batch, m.share, elements), d.Seconds(), obs)
			m.mu.Unlock()
		}
	}
	if f, ok := p.fallback.(*batchEWMA); ok {
		f.observeSize(name, batch, elements, took)
	} else {
		p.fallback.Observe(name, batch, took)
	}
}

// Busy is the execution time observed of a model since it was first seen,
// in seconds, summed over its concurrent executions: over a period, its
// increase divided by the period is how many executions of the model ran
// at once on average. On a GPU under MPS, where no CPU time measures the
// model's use of the device, it is the model's own utilisation signal.
func (p *Predictor) Busy(name string) float64 {
	m := p.get(name)
	if m == nil {
		return 0
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.busy
}

func (m *model) record(k bucket, predicted, observed float64) {
	m.recent[m.next] = pair{k, predicted, observed}
	m.next = (m.next + 1) % Window
	m.n = min(m.n+1, Window)
}

// ObserveArrivals takes a sample of the model's cumulative arrival counter,
// which the control loop reads about once a second. Samples must come in
// time order; one less than 100 ms after the previous is skipped, and a
// counter that goes backwards starts a new baseline.
func (p *Predictor) ObserveArrivals(name string, at time.Time, arrived uint64) {
	m := p.ensure(name)
	m.mu.Lock()
	m.rate.observe(at, arrived)
	m.mu.Unlock()
}

// ForecastRate returns the arrival rate (requests/s) expected horizon after
// the latest counter sample, never negative; 0 for an unknown model or
// before two samples. See rateModel for the method.
func (p *Predictor) ForecastRate(name string, horizon time.Duration) float64 {
	m := p.get(name)
	if m == nil {
		return 0
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.rate.forecast(horizon)
}

// Accuracy is how well a model's predictions have matched lately.
type Accuracy struct {
	Predicted, Observed time.Duration // means over the last Window executions
	MAPE                float64       // of those executions, predicted vs observed (0.07 is 7%)
	ProfileMAPE         float64       // of the fitted curve on its own profile points
	Correction          float64       // the model's online correction factor, over all its buckets
	Drift               bool          // the model's or a bucket's correction is over 2x either way: the profile does not fit what the model serves
	DriftBuckets        int           // buckets (shape, batch, share) whose correction is over 2x either way now
	DriftAlarms         uint64        // times a bucket's correction moved into drift
	Buckets             int           // buckets with a correction of their own
	Interference        float64       // current interference factor: oversubscription's times co-runners' (CoRunning, CoRunSlope)
	CoRunning           float64       // the co-running work's measured use of the device (SetCoRunning), latest period
	CoRunSlope          float64       // learned: log of the slowdown per unit of CoRunning
	ForecastRate        float64       // forecast for 1s after the latest counter sample, requests/s
	ObservedRate        float64       // rate of the latest counter interval, requests/s
	Samples             int           // executions in the window
	HasCurve            bool          // whether a profile is installed
	// MAPEFloor is the least MAPE the same executions could have had
	// with one predicted time for each bucket (row size in half-octaves,
	// batch size, share in twentieths), chosen in hindsight (the median
	// of the bucket's observed times weighted by 1/time): their jitter,
	// which no prediction that knows the shape, batch and share removes
	// (the machine's other work, preemptions). The MAPE above it is the
	// predictor's own error; a prediction that follows the machine's load
	// over time can be below it. A bucket with one execution in the
	// window counts 0.
	MAPEFloor float64
}

// Accuracy reports on a model; an unknown model gives the zero Accuracy
// with Correction and Interference 1.
func (p *Predictor) Accuracy(name string) Accuracy {
	m := p.get(name)
	if m == nil {
		return Accuracy{Correction: 1, Interference: 1}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.accuracy()
}

func (m *model) accuracy() Accuracy {
	a := Accuracy{
		ProfileMAPE:  m.profileMAPE,
		Correction:   m.correction,
		Drift:        m.correction > driftRatio || m.correction < 1/driftRatio,
		DriftAlarms:  m.alarms,
		Buckets:      len(m.buckets),
		Interference: interference(m.share, m.othersUtil) * m.co.factor(),
		CoRunning:    m.co.util,
		CoRunSlope:   m.co.slope,
		ForecastRate: m.rate.forecast(time.Second),
		ObservedRate: m.rate.lastRate,
		Samples:      m.n,
		HasCurve:     m.hasCurve,
	}
	for _, c := range m.buckets {
		if c.drift {
			a.DriftBuckets++
		}
	}
	a.Drift = a.Drift || a.DriftBuckets > 0
	if m.n == 0 {
		return a
	}
	var sp, so, se float64
	byKey := make(map[bucket][]float64, 8)
	for _, pr := range m.recent[:m.n] {
		sp += pr.predicted
		so += pr.observed
		se += math.Abs(pr.predicted-pr.observed) / pr.observed
		byKey[pr.key] = append(byKey[pr.key], pr.observed)
	}
	var sf float64
	for _, obs := range byKey {
		c := bestConstant(obs)
		for _, o := range obs {
			sf += math.Abs(c-o) / o
		}
	}
	n := float64(m.n)
	a.Predicted, a.Observed, a.MAPE, a.MAPEFloor = seconds(sp/n), seconds(so/n), se/n, sf/n
	return a
}

// bestConstant is the time c with the least sum of |c - o| / o over the
// observed times obs: their median weighted by 1/o (the sum is convex and
// piecewise linear in c, its slope at c the weight below c minus the
// weight above).
func bestConstant(obs []float64) float64 {
	obs = slices.Clone(obs)
	slices.Sort(obs)
	var total float64
	for _, o := range obs {
		total += 1 / o
	}
	var below float64
	for _, o := range obs {
		below += 1 / o
		if below >= total/2 {
			return o
		}
	}
	return obs[len(obs)-1]
}

// batchEWMA is the built-in fallback: an exponentially weighted average of
// the observed time per model, row-size bucket (sizeBucket) and batch
// size. For an unseen batch size it scales from the nearest smaller one
// proportionally to the batch (the pessimistic case of no batching gain)
// but no slower than the nearest larger one, or, below all known sizes,
// takes the smallest one's time. A row size never seen takes the nearest
// seen size's estimate scaled by the ratio of the sizes (time proportional
// to the elements).
type batchEWMA struct {
	alpha  float64
	mu     sync.Mutex
	models map[string]map[int]map[int]float64 // model -> size bucket -> batch -> seconds
}

func newBatchEWMA(alpha float64) *batchEWMA {
	return &batchEWMA{alpha: alpha, models: map[string]map[int]map[int]float64{}}
}

func (e *batchEWMA) Observe(name string, batch int, took time.Duration) {
	e.observeSize(name, batch, 0, took)
}

func (e *batchEWMA) observeSize(name string, batch int, elements int64, took time.Duration) {
	if batch < 1 || took <= 0 {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	bySize := e.models[name]
	if bySize == nil {
		bySize = map[int]map[int]float64{}
		e.models[name] = bySize
	}
	k := sizeBucket(elements)
	m := bySize[k]
	if m == nil {
		m = map[int]float64{}
		bySize[k] = m
	}
	if v, ok := m[batch]; ok {
		m[batch] = e.alpha*took.Seconds() + (1-e.alpha)*v
	} else {
		m[batch] = took.Seconds()
	}
}

func (e *batchEWMA) Estimate(name string, batch int) (time.Duration, bool) {
	return e.estimateSize(name, batch, 0)
}

func (e *batchEWMA) estimateSize(name string, batch int, elements int64) (time.Duration, bool) {
	batch = max(batch, 1)
	e.mu.Lock()
	defer e.mu.Unlock()
	bySize := e.models[name]
	if len(bySize) == 0 {
		return 0, false
	}
	k := sizeBucket(elements)
	scale := 1.0
	if _, ok := bySize[k]; !ok {
		// The nearest seen size; an unknown size is the nearest to any.
		near, best := 0, math.Inf(1)
		for s := range bySize {
			d := math.Abs(float64(s - k))
			if k < 0 || s < 0 {
				d = 1e9 + float64(s)
			}
			if d < best {
				near, best = s, d
			}
		}
		if k >= 0 && near >= 0 {
			scale = math.Exp2(float64(k-near) / 2)
		}
		k = near
	}
	m := bySize[k]
	if v, ok := m[batch]; ok {
		return seconds(v * scale), true
	}
	below, above := 0, 0
	for b := range m {
		if b < batch && b > below {
			below = b
		}
		if b > batch && (above == 0 || b < above) {
			above = b
		}
	}
	if below == 0 {
		return seconds(m[above] * scale), true
	}
	v := m[below] * float64(batch) / float64(below)
	if above > 0 {
		v = max(min(v, m[above]), m[below])
	}
	return seconds(v * scale), true
}

func (e *batchEWMA) forget(name string) {
	e.mu.Lock()
	delete(e.models, name)
	e.mu.Unlock()
}
