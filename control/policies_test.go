package control

import (
	"strings"
	"testing"
)

// Each policy is found by its name and says what it does; an unknown name
// is an error that names the known ones.
func TestPolicies(t *testing.T) {
	for _, tc := range []struct {
		name                           string
		forecasts, limits, backgrounds bool
	}{
		{SharePolicyAdaptive, true, true, true},
		{SharePolicyStatic, false, true, false},
		{SharePolicyShared, false, false, false},
	} {
		p, err := PolicyNamed(tc.name)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if p.Name() != tc.name || p.Forecasts() != tc.forecasts || p.Limits() != tc.limits || p.Backgrounds() != tc.backgrounds {
			t.Errorf("%s: name %q, forecasts %v, limits %v, backgrounds %v; want %v %v %v",
				tc.name, p.Name(), p.Forecasts(), p.Limits(), p.Backgrounds(), tc.forecasts, tc.limits, tc.backgrounds)
		}
	}
	if Policies[0].Name() != SharePolicyAdaptive {
		t.Errorf("the default policy is %s, want adaptive", Policies[0].Name())
	}
	if _, err := PolicyNamed("fair"); err == nil || !strings.Contains(err.Error(), `"fair"`) || !strings.Contains(err.Error(), SharePolicyShared) {
		t.Errorf("unknown policy: %v", err)
	}
}
