"""What docs/operator.md says of upgrading the CRD holds for the CRD as it is: one version, served
and stored, no conversion. A second version makes this fail until the upgrade notes say how."""
import pathlib

import helm_python as helm
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "serving.specfleet.dev_specdecodedeployments.yaml").read_text())
DOC = (ROOT / "docs" / "operator.md").read_text()


def test_one_version_served_and_stored_without_conversion_as_documented():
    versions = [(v["name"], v["served"], v["storage"]) for v in CRD["spec"]["versions"]]
    assert versions == [("v1alpha1", True, True)]
    assert CRD["spec"].get("conversion", {"strategy": "None"}) == {"strategy": "None"}
    assert "Today there is one version, `v1alpha1`, served and stored, with no conversion" in DOC


def test_the_upgrade_applies_the_crd_server_side_before_helm_upgrade():
    upgrade = DOC[DOC.index("## Upgrading"):]
    assert upgrade.index("kubectl apply --server-side -f crds/") < upgrade.index("helm upgrade specfleet")
    out = helm.Chart.load(str(ROOT / "charts" / "specfleet")).render({}, name="specfleet", namespace="ns",
                                                                     is_install=True)
    (notes,) = [text for path, text in out.items() if path.endswith("NOTES.txt")]
    assert "kubectl apply --server-side -f charts/specfleet/crds/" in notes
    assert (ROOT / "charts" / "specfleet" / "crds" / "serving.specfleet.dev_specdecodedeployments.yaml").exists()
