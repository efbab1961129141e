package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/sloserve/sloserve/configs"
	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/models"
	"github.com/sloserve/sloserve/predictor"
)

// Profile loads one model of the configured repositories the way the server
// does, with its profiling sweep (or the cached result, unless fresh), and
// writes the measured points, the fitted curve and its error to out. No
// listener is opened and no request is served.
func Profile(ctx context.Context, cfg *configs.Server, model string, fresh bool, out io.Writer, logger *slog.Logger) error {
	var reported bool
	var h *house
	h, err := assemble(cfg, logger, assembly{profile: &profileRequest{model: model, fresh: fresh,
		report: func(run models.ProfileRun, p predictor.Profile, cached bool) {
			reported = true
			writeProfile(out, run, p, cached, h.devs.Limiter(run.Device))
		}}})
	if err != nil {
		return err
	}
	defer h.close()
	reg := h.reg
	startErr := reg.Start(ctx)
	defer reg.Stop(context.WithoutCancel(ctx))
	if startErr != nil {
		return startErr
	}
	if _, dev, err := reg.VersionKey(model, ""); err == nil && h.devs.Lookup(dev) == nil {
		if _, err := h.devs.Scheduler(dev); err != nil {
			return fmt.Errorf("limiter: %w", err)
		}
	}
	if !reported {
		for _, e := range reg.Index(false) {
			if e.Name == model && e.Reason != "" {
				return fmt.Errorf("model %s: %s: %s", model, e.State, e.Reason)
			}
		}
		if _, err := reg.ModelReady(model, ""); err != nil {
			return err
		}
		return errors.New("the model was loaded but not profiled: an input has BYTES data or is over limits.max_tensor_elements, " +
			"or shares are not enforced here (control.limiter none, or no writable cgroups); the log above says which")
	}
	return nil
}

// writeProfile prints a profile: where it came from, each point measured
// against the curve, the curve and its error.
func writeProfile(w io.Writer, run models.ProfileRun, p predictor.Profile, cached bool, lim limiter.Limiter) {
	src := "measured now"
	if cached {
		src = "from the cache (profiled " + p.Created.Format(time.RFC3339) + "; --fresh profiles again)"
	}
	fmt.Fprintf(w, "model %s on %s, %d intra-op thread(s), shares of the device up to %.3f\n", run.Key, run.Device, run.Threads, run.MaxShare)
	if lim != nil {
		fmt.Fprintf(w, "limiter %s (%d CPUs): %s\n", lim.Kind(), lim.CPUs(), lim.Describe())
	}
	fmt.Fprintf(w, "profile %s\n\n", src)
	memory := slices.ContainsFunc(p.Points, func(pt predictor.Point) bool { return pt.Memory > 0 })
	sizes := slices.ContainsFunc(p.Points, func(pt predictor.Point) bool { return pt.Elements != p.Points[0].Elements })
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	header := "batch\tshare\tmeasured ms\tcurve ms\terror\t"
	if sizes {
		header = "elements\t" + header // of one row: the input shape's size
	}
	if memory {
		header += "peak MiB\t" // the instance's peak memory so far: the working sets
	}
	fmt.Fprintln(tw, header)
	for _, pt := range p.Points {
		pred := p.Curve.PredictSize(pt.Batch, pt.Share, pt.Elements)
		errPct := 100 * (float64(pred) - float64(pt.Latency)) / float64(pt.Latency)
		if sizes {
			fmt.Fprintf(tw, "%d\t", pt.Elements)
		}
		fmt.Fprintf(tw, "%d\t%.3f\t%.2f\t%.2f\t%+.1f%%\t", pt.Batch, pt.Share, millis(pt.Latency), millis(pred), errPct)
		if memory {
			fmt.Fprintf(tw, "%.1f\t", float64(pt.Memory)/(1<<20))
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
	c := p.Curve
	fmt.Fprintf(w, "\nt(b, s) = (%.4g*b^2 + %.4g*b + %.4g) / (s + %.4g) + %.4g seconds\n", c.K1, c.K2, c.K3, c.K4, c.K5)
	if c.Elements > 0 {
		fmt.Fprintf(w, "in size: b stands for w = b*n/%.0f (n: elements of a row), plus %.4g*b / (s + %.4g) per row\n", c.Elements, c.K6, c.K4)
	}
	fmt.Fprintf(w, "MAPE %.1f%% over %d points\n", 100*p.MAPE, len(p.Points))
}

func millis(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
