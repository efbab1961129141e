package control

import "testing"

func TestIsolation(t *testing.T) {
	var nilIso *Isolation
	if _, ok := nilIso.Risky("a"); ok || nilIso.Models() != nil {
		t.Error("a nil Isolation holds a model")
	}
	var iso Isolation
	if _, ok := iso.Risky("be"); ok {
		t.Error("an empty Isolation holds be")
	}
	if !iso.Mark("be", "faulted twice") || iso.Mark("be", "again") {
		t.Error("Mark: want true the first time, false after")
	}
	if why, ok := iso.Risky("be"); !ok || why != "faulted twice" {
		t.Errorf("Risky(be) = %q, %v", why, ok)
	}
	if m := iso.Models(); len(m) != 1 || m["be"] != "faulted twice" {
		t.Errorf("Models() = %v", m)
	}
}
