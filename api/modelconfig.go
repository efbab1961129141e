package api

import (
	"context"
	"net/http"

	"github.com/gin-gonic/gin"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/sloserve/sloserve/api/inference"
	"github.com/sloserve/sloserve/configs"
)

// ModelConfig answers a model version's config in Triton's ModelConfig
// shape (configs.TritonConfig), whichever file it was read from.
func (s *grpcService) ModelConfig(_ context.Context, req *inference.ModelConfigRequest) (*inference.ModelConfigResponse, error) {
	cfg, err := s.b.ModelConfig(req.GetName(), req.GetVersion())
	if err != nil {
		return nil, s.grpcError("ModelConfig", err)
	}
	return &inference.ModelConfigResponse{Config: configs.TritonConfig(cfg)}, nil
}

// modelConfig serves GET /v2/models/{m}[/versions/{v}]/config: the same
// message as gRPC's ModelConfig, as Triton writes it in JSON (the config
// itself, not wrapped; proto field names; integers as JSON numbers).
func (s *restServer) modelConfig(c *gin.Context) {
	cfg, err := s.b.ModelConfig(c.Param("model"), c.Param("version"))
	if err != nil {
		s.writeError(c, err)
		return
	}
	s.writeValue(c, http.StatusOK, protoJSON(configs.TritonConfig(cfg).ProtoReflect()))
}

// protoJSON turns a message into the JSON value Triton answers for it: an
// object keyed by proto field names, with every scalar, list and map field
// (defaults too, so readers find max_batch_size 0), set message fields
// only, enums by name and 64-bit integers as numbers, not the strings of
// protojson.
func protoJSON(m protoreflect.Message) map[string]any {
	out := map[string]any{}
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		switch {
		case fd.ContainingOneof() != nil || fd.Kind() == protoreflect.MessageKind && !fd.IsList() && !fd.IsMap():
			if !m.Has(fd) {
				continue
			}
		}
		v := m.Get(fd)
		switch {
		case fd.IsList():
			l := v.List()
			vals := make([]any, l.Len())
			for j := range l.Len() {
				vals[j] = protoJSONScalar(fd, l.Get(j))
			}
			out[string(fd.Name())] = vals
		case fd.IsMap():
			vals := map[string]any{}
			v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				vals[k.String()] = protoJSONScalar(fd.MapValue(), mv)
				return true
			})
			out[string(fd.Name())] = vals
		default:
			out[string(fd.Name())] = protoJSONScalar(fd, v)
		}
	}
	return out
}

func protoJSONScalar(fd protoreflect.FieldDescriptor, v protoreflect.Value) any {
	switch fd.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		return protoJSON(v.Message())
	case protoreflect.EnumKind:
		if ev := fd.Enum().Values().ByNumber(v.Enum()); ev != nil {
			return string(ev.Name())
		}
		return int32(v.Enum())
	case protoreflect.BytesKind:
		return v.Bytes()
	default:
		return v.Interface()
	}
}
