"""The custom resources' API, one subpackage per version (as the CRDs in crds/ declare them)."""
