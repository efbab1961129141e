package control

import (
	"fmt"
	"time"

	"github.com/sloserve/sloserve/qos"
)

// Share policies: how an Adjuster divides its device among the models,
// by the names the config and events use.
const (
	// SharePolicyAdaptive is sloserve's loop: each latency-critical model
	// gets the smallest share predicted to meet its SLO at its forecast
	// rate, best-effort models split what is left.
	SharePolicyAdaptive = "adaptive"
	// SharePolicyStatic gives every model an equal, fixed share of compute
	// (and of the memory budget when one is set), like a dedicated slice.
	SharePolicyStatic = "static"
	// SharePolicyShared sets no limits: every model gets Share{} and they
	// all contend for the device.
	SharePolicyShared = "shared"
)

// Policy is a share policy: how an Adjuster divides its device among the
// models, and what that asks of the parts around it. Callers ask a policy
// what it does rather than compare its name.
type Policy interface {
	// Name is the policy's name (SharePolicy*).
	Name() string
	// Forecasts: the policy sizes shares from each model's forecast rate
	// and predicted latency (it needs a predictor), sizes memory shares
	// from working sets and evicts idle models over a memory budget.
	Forecasts() bool
	// Limits: the policy limits the models; false leaves each unlimited,
	// so no limiter needs to enforce anything.
	Limits() bool
	// Backgrounds: best-effort models run in the background class
	// (limiter.ModeBackground) where the limiter has one, behind the
	// latency-critical models.
	Backgrounds() bool
	// decide fills the plan of one pass.
	decide(a *Adjuster, now time.Time, states []qos.ModelState, p *plan)
}

// Policies are the share policies, the default first.
var Policies = []Policy{adaptivePolicy{}, staticPolicy{}, sharedPolicy{}}

// PolicyNamed is the share policy of a name.
func PolicyNamed(name string) (Policy, error) {
	for _, p := range Policies {
		if p.Name() == name {
			return p, nil
		}
	}
	return nil, fmt.Errorf("unknown share policy %q (want %q, %q or %q)", name, SharePolicyAdaptive, SharePolicyStatic, SharePolicyShared)
}

type adaptivePolicy struct{}

func (adaptivePolicy) Name() string      { return SharePolicyAdaptive }
func (adaptivePolicy) Forecasts() bool   { return true }
func (adaptivePolicy) Limits() bool      { return true }
func (adaptivePolicy) Backgrounds() bool { return true }

func (adaptivePolicy) decide(a *Adjuster, now time.Time, states []qos.ModelState, p *plan) {
	for _, st := range states {
		a.opts.Predictor.ObserveArrivals(st.Spec.Name, now, st.Arrived)
	}
	a.decideAdaptive(now, states, p)
}

type staticPolicy struct{}

func (staticPolicy) Name() string      { return SharePolicyStatic }
func (staticPolicy) Forecasts() bool   { return false }
func (staticPolicy) Limits() bool      { return true }
func (staticPolicy) Backgrounds() bool { return false }

func (staticPolicy) decide(a *Adjuster, now time.Time, states []qos.ModelState, p *plan) {
	a.decideStatic(now, states, p)
}

type sharedPolicy struct{}

func (sharedPolicy) Name() string      { return SharePolicyShared }
func (sharedPolicy) Forecasts() bool   { return false }
func (sharedPolicy) Limits() bool      { return false }
func (sharedPolicy) Backgrounds() bool { return false }

func (sharedPolicy) decide(a *Adjuster, now time.Time, states []qos.ModelState, p *plan) {
	a.decideShared(now, states, p)
}
