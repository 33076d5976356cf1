import pytest

from vlrl.rewards import get_reward
from vlrl.rewards.boxes import average_precision, box_iou, greedy_precision_recall, parse_boxes


def test_parse_boxes_forms():
    assert parse_boxes("[1, 2, 3, 4] and (5,6,7,8)") == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert parse_boxes("(10, 20), (30, 40)") == [[10, 20, 30, 40]]
    assert parse_boxes('{"bbox_2d": [0.1, 0.2, 0.5, 0.6]}') == [[0.1, 0.2, 0.5, 0.6]]
    assert parse_boxes("1 2 3 4") == []  # no commas: not a box
    assert parse_boxes("[1, 2, 3]") == []


def test_box_iou_by_hand():
    # [0,0,10,10] vs [5,5,15,15]: intersection 5*5 = 25, union 100 + 100 - 25 = 175
    assert box_iou([0, 0, 10, 10], [5, 5, 15, 15]) == pytest.approx(25 / 175)
    assert box_iou([0, 0, 10, 10], [20, 20, 30, 30]) == 0.0
    assert box_iou([5, 5, 5, 9], [0, 0, 10, 10]) == 0.0  # degenerate


def test_bbox_iou_reward():
    bbox = get_reward("bbox_iou")
    out = bbox("<answer>[0, 0, 10, 10]</answer>", [0, 0, 10, 20])  # 100 / 200
    assert out.overall == pytest.approx(0.5) and out.parts["accuracy"] == 1.0
    assert bbox("<answer>(0,0,10,10)</answer>", "[5, 5, 15, 15]").parts["accuracy"] == 0.0
    assert bbox("no box here", [0, 0, 1, 1]).overall == 0.0
    # only the first box counts: listing the right box second earns IoU([0,0,1,1], gt) = 1 / 200
    assert bbox("<answer>[0, 0, 1, 1], [0, 0, 10, 20]</answer>", [0, 0, 10, 20]).overall == pytest.approx(0.005)


def test_bbox_iou_coordinate_systems():
    bbox = get_reward("bbox_iou")
    # image 200x100; gt in pixels [20, 10, 100, 50]; a 0-1 prediction [0.1, 0.1, 0.5, 0.5] is the same box
    assert bbox("<answer>[0.1, 0.1, 0.5, 0.5]</answer>", [20, 10, 100, 50], image_size=(200, 100)).overall == 1.0
    # both in 0-1000 without an image size: compared as they are
    assert bbox("<answer>[100, 100, 500, 500]</answer>", [100, 100, 500, 500], coords="norm1000").overall == 1.0
    # gt in 0-1000 with an image size: [100, 100, 500, 500] on 200x100 = [20, 10, 100, 50] px; a 0-1 answer matches
    assert bbox("<answer>[0.1, 0.1, 0.5, 0.5]</answer>", [100, 100, 500, 500], coords="norm1000",
                image_size=(200, 100)).overall == pytest.approx(1.0)


def test_average_precision_by_hand():
    gt = [[0, 0, 10, 10]]
    # TP then FP: precision [1, 1/2], recall [1, 1] → interpolated precision 1 at every recall → AP 1
    assert average_precision([[0, 0, 10, 10], [50, 50, 60, 60]], gt, 0.5) == pytest.approx(1.0)
    # FP then TP: precision [0, 1/2], envelope [1/2, 1/2], recall [0, 1] → AP 1/2
    assert average_precision([[50, 50, 60, 60], [0, 0, 10, 10]], gt, 0.5) == pytest.approx(0.5)
    assert average_precision([], gt, 0.5) == 0.0


def test_ovd_map_redundancy_penalty_by_hand():
    ovd = get_reward("ovd_map")
    gt = [{"bbox_2d": [0, 0, 10, 10], "label": "cat"}, {"bbox_2d": [20, 20, 30, 30], "label": "dog"}]
    exact = '[{"bbox_2d": [0, 0, 10, 10], "label": "cat"}, {"bbox_2d": [20, 20, 30, 30], "label": "Dog"}]'
    out = ovd(f"```json\n{exact}\n```", gt)
    assert out.overall == pytest.approx(1.0) and out.parts["redundancy"] == 1.0
    # a third, wrong box: each class AP stays 1 (the FP comes after the TP) → mAP 1; s = min(1, 2/3)
    extra = exact[:-1] + ', {"bbox_2d": [50, 50, 60, 60], "label": "cat"}]'
    out = ovd(extra, gt)
    assert out.parts["map"] == pytest.approx(1.0)
    assert out.overall == pytest.approx(2 / 3) and out.parts["redundancy"] == pytest.approx(2 / 3)
    assert out.parts["greedy_precision"] == pytest.approx(2 / 3) and out.parts["greedy_recall"] == 1.0
    assert ovd("I see nothing", gt).overall == 0.0
    assert ovd("[]", []).overall == 1.0  # nothing to find, nothing claimed
    with pytest.raises(ValueError, match="detection"):
        ovd("[]", [{"label": "cat"}])  # malformed ground truth is a data error, not a zero


def test_ovd_map_iou_thresholds():
    ovd = get_reward("ovd_map")
    gt = [{"bbox_2d": [0, 0, 10, 10], "label": "cat"}]
    shifted = '[{"bbox_2d": [0, 0, 10, 20], "label": "cat"}]'  # IoU 0.5
    # COCO thresholds 0.50..0.95: only 0.50 is met → mAP = 1/10
    assert ovd(shifted, gt).overall == pytest.approx(0.1)
    assert ovd(shifted, gt, iou_thresholds=[0.5]).overall == pytest.approx(1.0)


def test_greedy_precision_recall():
    truth = [([0, 0, 10, 10], "a"), ([20, 20, 30, 30], "a")]
    predicted = [([0, 0, 10, 10], "a"), ([0, 0, 10, 10], "a"), ([20, 20, 30, 30], "b")]
    # one match (the duplicate and the wrong label do not count): GP = 1/3, GR = 1/2
    assert greedy_precision_recall(predicted, truth) == pytest.approx((1 / 3, 1 / 2))
