package dashboard

import (
	"fmt"
	"strings"
	"time"
)

// diagnose gives a model's status and, when it misses its SLO, one
// sentence saying by how much and the likely causes, in the order a person
// would check them: requests refused, the share the model got against the
// share it needs, the predictor's error, load above the forecast, and
// queueing behind other work.
func diagnose(o *ModelOverview, m *ModelSample, target float64, window time.Duration) (status, why string) {
	if !o.SLOms.Known() {
		return StatusNoSLO, ""
	}
	refused := o.RejectedDeadline + o.RejectedQueueFull + o.Dropped + o.Failed
	if !o.Attainment.Known() && !o.P99ms.Known() && refused == 0 {
		return StatusIdle, ""
	}
	overP99 := o.P99ms.Known() && o.P99ms > o.SLOms
	// Requests refused and none answered: nothing was attained.
	lowAttainment := o.Attainment.Known() && float64(o.Attainment) < target || !o.Attainment.Known() && refused > 0
	if !overP99 && !lowAttainment {
		return StatusOK, ""
	}

	var what []string
	if lowAttainment {
		what = append(what, fmt.Sprintf("attainment %s is below the %s target", pct(cmpValue(o.Attainment, 0)), pct(Value(target))))
	}
	if overP99 {
		what = append(what, fmt.Sprintf("p99 %s is over the %s SLO", msText(o.P99ms), msText(o.SLOms)))
	}

	var causes []string
	if refused > 0 {
		var parts []string
		for _, c := range []struct {
			n    Value
			name string
		}{
			{o.RejectedDeadline, "rejected at admission (deadline unreachable)"},
			{o.RejectedQueueFull, "rejected (queue full)"},
			{o.Dropped, "dropped in the queue"},
			{o.Failed, "failed"},
		} {
			if c.n > 0 {
				parts = append(parts, fmt.Sprintf("%.0f %s", float64(c.n), c.name))
			}
		}
		causes = append(causes, strings.Join(parts, ", ")+fmt.Sprintf(" in the last %s", window))
	}
	causes = append(causes, shareCause(o, m)...)
	if o.ObservedMs.Known() && o.PredictedMs.Known() && o.ObservedMs > 1.25*o.PredictedMs {
		c := fmt.Sprintf("runs slower than predicted (%s observed vs %s predicted", msText(o.ObservedMs), msText(o.PredictedMs))
		if m.Interference > 1.05 {
			c += fmt.Sprintf(", interference x%.2f", m.Interference)
		}
		causes = append(causes, c+")")
	}
	if o.ForecastRate.Known() && o.ArrivalRate.Known() && o.ArrivalRate > 1.2*o.ForecastRate && o.ArrivalRate-o.ForecastRate > 0.5 {
		causes = append(causes, fmt.Sprintf("load %s req/s is above the %s req/s forecast", num(o.ArrivalRate), num(o.ForecastRate)))
	}
	if o.P50ms.Known() && o.ObservedMs.Known() && o.P50ms > 2*o.ObservedMs {
		c := fmt.Sprintf("requests wait: p50 %s against %s of execution", msText(o.P50ms), msText(o.ObservedMs))
		if o.QueueDepth > 0 {
			c += fmt.Sprintf(", %.0f queued", float64(o.QueueDepth))
		}
		causes = append(causes, c)
	}
	why = strings.Join(what, " and ")
	if len(causes) > 0 {
		why += ": " + strings.Join(causes, "; ")
	}
	return StatusMissing, why
}

// shareCause explains the model's share when it may be what holds it back.
func shareCause(o *ModelOverview, m *ModelSample) []string {
	share := float64(o.ComputeShare)
	switch {
	case m.Pinned:
		return []string{fmt.Sprintf("its compute share is pinned at %s", shareText(share))}
	case m.ShareSource == "static":
		return []string{fmt.Sprintf("the static policy holds its compute share at %s", shareText(share))}
	case m.ShareSource == "shared" || share <= 0:
		return []string{"no compute limit: it contends with every other model for the device"}
	case o.TargetShare.Known() && float64(o.TargetShare) > share+0.01:
		return []string{fmt.Sprintf("compute share %s is below the %s the adjuster wants", shareText(share), shareText(float64(o.TargetShare)))}
	case o.PlannedMs.Known() && o.PlannedMs > o.SLOms:
		return []string{fmt.Sprintf("even its largest share is predicted to take %s", msText(o.PlannedMs))}
	}
	return nil
}

func pct(v Value) string { return fmt.Sprintf("%.1f%%", 100*float64(v)) }

func msText(v Value) string {
	if v >= 100 {
		return fmt.Sprintf("%.0f ms", float64(v))
	}
	return fmt.Sprintf("%.1f ms", float64(v))
}

func num(v Value) string {
	if v >= 10 {
		return fmt.Sprintf("%.0f", float64(v))
	}
	return fmt.Sprintf("%.1f", float64(v))
}

func shareText(s float64) string {
	if s <= 0 || s >= 1 {
		return "the whole device"
	}
	return fmt.Sprintf("%.2f", s)
}

// cmpValue is v, or otherwise when v is unknown.
func cmpValue(v, otherwise Value) Value {
	if v.Known() {
		return v
	}
	return otherwise
}
